"""An all-reduce through shared memory, for ranks on one x86-64 host: a few microseconds where gloo's TCP round
trips take about a millisecond, and each step makes two per layer.

One file in /dev/shm, mapped by every rank: a flag per rank (its own cache line), then two buffers of one slot per
rank. A rank copies its partial sum into its slot of buffer `generation % 2`, then raises its flag to the
generation; once every flag has reached it, each rank adds the slots up in rank order (in float32), so all ranks
get the same bits. Two buffers are enough: no rank can write buffer g % 2 again before every rank has raised its
flag to g + 1, which it does only after it has read buffer g % 2. Tensors larger than a slot go in pieces.

x86-64 keeps stores in program order and loads in program order (TSO), which is what the flag protocol relies on;
elsewhere, and for ranks on several hosts, gloo's all-reduce is used instead.
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

SLOT_BYTES = 4 << 20  # per rank and buffer: a 512-token micro-batch of 2048 float32 activations in one piece
FLAG_STRIDE = 64  # bytes: one cache line per flag
SHM_DIR = Path("/dev/shm")
CHECK_EVERY = 1024  # spins between looks at the clock and at the group's health
YIELD_AFTER = 256  # spins (about half a millisecond) before each further spin also yields the core: with more
# runnable processes than cores, the rank being waited for may need this one's core


def available() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def create_file(size: int) -> Path:
    """The shared file for `size` ranks, zero-filled; rank 0 removes its name once every rank has mapped it."""
    fd, name = tempfile.mkstemp(prefix="kvlm-tp-", dir=SHM_DIR)
    try:
        os.ftruncate(fd, _file_bytes(size))
    finally:
        os.close(fd)
    return Path(name)


def _file_bytes(size: int) -> int:
    return FLAG_STRIDE * size + 2 * size * SLOT_BYTES


class SharedMemoryAllReduce:
    def __init__(self, path: Path, rank: int, size: int, timeout_s: float,
                 failed: Callable[[], bool] = lambda: False) -> None:
        """`failed`: looked at while waiting for the other ranks; True ends the wait with an error."""
        self.rank, self.size, self.timeout_s, self.failed = rank, size, timeout_s, failed
        memory = torch.from_file(str(path), shared=True, size=_file_bytes(size), dtype=torch.uint8)
        self._flags = memory[: FLAG_STRIDE * size].numpy().view(np.int64)[:: FLAG_STRIDE // 8]
        self._buffers = memory[FLAG_STRIDE * size :].view(2, size, SLOT_BYTES)
        self._generation = 0

    def __call__(self, tensor: torch.Tensor) -> None:
        """Replace `tensor` by the sum of every rank's `tensor`, in place."""
        if not tensor.is_contiguous():
            summed = tensor.contiguous()
            self(summed)
            tensor.copy_(summed)
            return
        flat = tensor.view(-1)
        per_piece = SLOT_BYTES // tensor.element_size()
        for start in range(0, flat.numel(), per_piece):
            self._reduce_piece(flat[start : start + per_piece])

    def _reduce_piece(self, piece: torch.Tensor) -> None:
        self._generation += 1
        buffer = self._buffers[self._generation % 2]
        slots = buffer[:, : piece.numel() * piece.element_size()].view(piece.dtype)
        slots[self.rank].copy_(piece)
        self._flags[self.rank] = self._generation
        self._wait_for_all(self._generation)
        total = slots[0].to(torch.float32, copy=True)  # never add into a slot another rank still reads
        for rank in range(1, self.size):
            total += slots[rank]
        piece.copy_(total)

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
