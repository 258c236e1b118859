"""The two collectives a tensor-parallel step makes: an all-reduce of partial sums after each attention output and
each MLP, and a gather of the logits, whose vocabulary is split between the ranks (to rank 0, which samples).

Through shared memory for ranks on one x86-64 host (a few microseconds where gloo's TCP round trips take about a
millisecond, and a step makes two all-reduces per layer); through the default group otherwise (gloo between CPUs,
NCCL between GPUs).

The shared memory is one file in /dev/shm, mapped by every rank: a flag per rank (its own cache line), then two
buffers of one slot per rank. A rank copies its part into its slot of buffer `generation % 2`, then raises its flag
to the generation; once every flag has reached it, each rank reads the slots: an all-reduce adds them up in rank
order (in float32), so all ranks get the same bits; a gather puts them side by side on rank 0. Two buffers are
enough: no rank can write buffer g % 2 again before every rank has raised its flag to g + 1, which it does only
after it has read buffer g % 2. What does not fit a slot goes in pieces. x86-64 keeps stores in program order and
loads in program order (TSO), which is what the flag protocol relies on.
"""
from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 4 << 20  # per rank and buffer: a 512-token micro-batch of 2048 float32 activations in one piece
FLAG_STRIDE = 64  # bytes: one cache line per flag
SHM_DIR = Path("/dev/shm")
CHECK_EVERY = 1024  # spins between looks at the clock and at the group's health
YIELD_AFTER = 256  # spins (about half a millisecond) before each further spin also yields the core: with more
# runnable processes than cores, the rank being waited for may need this one's core


def available() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def create_file(size: int) -> Path | None:
    """The shared file for `size` ranks, zero-filled; rank 0 removes its name once every rank has mapped it. None
    if /dev/shm has no room for it (a small container's), rather than a crash (SIGBUS) when a slot is touched."""
    fd, name = tempfile.mkstemp(prefix="kvlm-tp-", dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, _file_bytes(size))
    except OSError:
        os.unlink(name)
        return None
    finally:
        os.close(fd)
    return Path(name)


def _file_bytes(size: int) -> int:
    return FLAG_STRIDE * size + 2 * size * SLOT_BYTES


def make_collectives(rank: int, vocab_shares: list[int], shared_file: Path | None, timeout_s: float,
                     failed: Callable[[], bool] = lambda: False) -> GroupCollectives | SharedMemoryCollectives:
    """Through `shared_file` when the ranks have one (CPUs on one host), else through the default group."""
    if shared_file is None:
        return GroupCollectives(vocab_shares)
    return SharedMemoryCollectives(shared_file, rank, vocab_shares, timeout_s, failed)


def vocab_shares(vocab_size: int, size: int) -> list[int]:
    """How many rows of the LM head each rank holds: equal shares, the first ones one row larger if need be."""
    return [vocab_size // size + (rank < vocab_size % size) for rank in range(size)]


class GroupCollectives:
    """Over the default process group (any hosts; gloo's, or NCCL's for tensors on GPUs), with its timeout."""

    def __init__(self, vocab_shares: list[int]) -> None:
        self.vocab_shares = vocab_shares

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def gather_vocab(self, part: torch.Tensor) -> torch.Tensor:
        """Rank 0: the logits of every rank's vocabulary side by side; other ranks: their part."""
        widest = max(self.vocab_shares)
        padded = torch.nn.functional.pad(part, (0, widest - part.shape[1])).contiguous()
        parts = [torch.empty_like(padded) for _ in self.vocab_shares] if dist.get_rank() == 0 else None
        dist.gather(padded, parts, dst=0)
        if parts is None:
            return part
        return torch.cat([p[:, :width] for p, width in zip(parts, self.vocab_shares)], dim=1)


class SharedMemoryCollectives:
    def __init__(self, path: Path, rank: int, vocab_shares: list[int], timeout_s: float,
                 failed: Callable[[], bool] = lambda: False) -> None:
        """`failed`: looked at while waiting for the other ranks; True ends the wait with an error."""
        self.rank, self.size, self.vocab_shares = rank, len(vocab_shares), vocab_shares
        self.timeout_s, self.failed = timeout_s, failed
        size = self.size
        if not path.exists():  # torch.from_file would make a new, unshared file
            raise FileNotFoundError(f"the tensor-parallel shared file {path} is gone")
        memory = torch.from_file(str(path), shared=True, size=_file_bytes(size), dtype=torch.uint8)
        self._flags = memory[: FLAG_STRIDE * size].numpy().view(np.int64)[:: FLAG_STRIDE // 8]
        self._buffers = memory[FLAG_STRIDE * size :].view(2, size, SLOT_BYTES)
        self._generation = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Replace `tensor` by the sum of every rank's `tensor`, in place."""
        if not tensor.is_contiguous():
            summed = tensor.contiguous()
            self.all_reduce(summed)
            tensor.copy_(summed)
            return
        flat = tensor.view(-1)
        per_piece = SLOT_BYTES // tensor.element_size()
        for start in range(0, flat.numel(), per_piece):
            piece = flat[start : start + per_piece]
            slots = self._exchange(piece)[:, : piece.numel()]
            total = slots[0].to(torch.float32, copy=True)  # never add into a slot another rank still reads
            for rank in range(1, self.size):
                total += slots[rank]
            piece.copy_(total)

    def gather_vocab(self, part: torch.Tensor) -> torch.Tensor:
        """Rank 0: the logits [rows, vocab] of every rank's vocabulary side by side; other ranks: their part."""
        rows_per_piece = max(1, SLOT_BYTES // (max(self.vocab_shares) * part.element_size()))
        pieces = []
        for start in range(0, part.shape[0], rows_per_piece):
            piece = part[start : start + rows_per_piece].contiguous()
            slots = self._exchange(piece.view(-1))
            if self.rank == 0:
                n = piece.shape[0]
                pieces.append(torch.cat([slots[r, : n * width].view(n, width)
                                         for r, width in enumerate(self.vocab_shares)], dim=1))
        if self.rank != 0:
            return part
        return torch.cat(pieces) if pieces else part.new_empty((0, sum(self.vocab_shares)))

    def _exchange(self, piece: torch.Tensor) -> torch.Tensor:
        """Publish this rank's (flat) piece, wait for everyone's; every rank's piece, [ranks, ...] in its slots."""
        self._generation += 1
        buffer = self._buffers[self._generation % 2]
        slots = buffer[:, : SLOT_BYTES // piece.element_size() * piece.element_size()].view(piece.dtype)
        slots[self.rank, : piece.numel()].copy_(piece)
        self._flags[self.rank] = self._generation
        self._wait_for_all(self._generation)
        return slots

    def _wait_for_all(self, generation: int) -> None:
        flags, spins, deadline = self._flags, 0, time.monotonic() + self.timeout_s
        while not (flags >= generation).all():
            spins += 1
            if spins % CHECK_EVERY == 0:
                if self.failed():
                    raise RuntimeError("the group failed while this rank waited for the others' partial sums")
                if time.monotonic() > deadline:
                    waiting = [r for r in range(self.size) if flags[r] < generation]
                    raise RuntimeError(f"timed out after {self.timeout_s:.0f} s waiting for rank(s) {waiting} "
                                       f"(shared-memory all-reduce)")
            if spins > YIELD_AFTER:
                os.sched_yield()
