"""Rank 0 of a tensor-parallel model: it owns the scheduler, the cells and sampling, and tells the other ranks
what to do.

The other ranks keep memories of their own (the same kind and sizes, their KV heads only) and repeat, in the
same order, every call that changed rank 0's memory: the bookkeeping is the memory protocol's own code on every
rank, never a copy by hand. Calls are recorded as they happen and sent together just before each forward pass,
with its tokens and positions, in one message. All ranks then run the pass, adding up their partial sums with
an all-reduce after each attention output and each MLP.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import logging
import re
import struct
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlm.memory.seq_state import check_state
from kvlm.parallel.collectives import make_collectives, vocab_shares
from kvlm.parallel.group import (
    COLLECTIVE_TIMEOUT,
    TensorParallelError,
    loaded_barrier,
    rank_statuses,
    stop_workers,
    worker_error,
)

log = logging.getLogger("kvlm")

# The memory protocol's calls that change a memory: the other ranks repeat them. READS change nothing; a test
# checks that every call of the protocol is in one of the two (or saves and loads state, which gather and scatter).
MUTATING = frozenset({"retain", "share", "unshare", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear",
                      "compact", "apply_shifts", "begin", "place", "commit", "roll_back", "restore"})
READS = frozenset({"kind", "pools", "n_cells", "n_used", "kv_bytes", "cells_short", "seq_pos_min", "seq_pos_max",
                   "split", "plan", "checkpoint"})
STATE_MAGIC = b"KVTP"
WATCH_INTERVAL_S = 0.5
STOP_GRACE_S = 10.0


class Leader:
    def __init__(self, size: int, control: dist.ProcessGroup, workers: mp.ProcessContext | None,
                 shared_file: Path | None = None) -> None:
        """`workers`: the ranks this process started (None when torchrun started them); `shared_file`: the
        collectives go through it (ranks on one host, see kvlm.parallel.collectives), else through gloo."""
        self.size, self.control, self.workers = size, control, workers
        self.shared_file = shared_file
        self._wire = None
        self.failure: str | None = None
        self.on_failure: list[Callable[[str], None]] = []  # e.g. the server stopping
        self._pending: list[tuple] = []
        self._memory_ids = itertools.count()
        self._lock = threading.Lock()
        self._stopped = False
        self._busy: tuple[str, float] | None = None  # the collective under way, since when
        threading.Thread(target=self._watch, name="kvlm-tp-watch", daemon=True).start()
        atexit.register(self.stop)

    def mirrored(self, memory, sizes: dict) -> MirroredMemory:
        return MirroredMemory(memory, self, next(self._memory_ids), sizes)

    # --- messages to the other ranks ---
    def record(self, command: tuple) -> None:
        self._pending.append(command)

    def send(self, *commands: tuple) -> None:
        """What was recorded since the last message, then `commands`, to every other rank."""
        pending, self._pending = self._pending, []
        message = pending + list(commands)
        self._collective("sending a step", dist.broadcast_object_list, [message], src=0, group=self.control)

    def connect(self, decoder) -> None:
        """Route the decoder's partial sums and logits through the other ranks."""
        self._wire = make_collectives(0, vocab_shares(decoder.config.vocab_size, self.size), self.shared_file,
                                      COLLECTIVE_TIMEOUT.total_seconds(), failed=lambda: self.failure is not None)
        decoder.all_reduce, decoder.gather_logits = self.all_reduce, self.gather_logits

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._collective("all-reduce", self._wire.all_reduce, tensor)

    def gather_logits(self, part: torch.Tensor) -> torch.Tensor:
        return self._collective("gathering logits", self._wire.gather_vocab, part)

    def gather(self, part) -> list:
        parts = [None] * self.size
        self._collective("gathering", dist.gather_object, part, parts, dst=0)
        return parts

    def barrier(self) -> None:
        """Wait until every rank has loaded its shard (and mapped the shared file, whose name can then go)."""
        try:
            self._collective("waiting for every rank to load", loaded_barrier, self.control, watched=False)
        finally:
            self._remove_shared_file()

    def _remove_shared_file(self) -> None:
        if self.shared_file is not None:
            self.shared_file.unlink(missing_ok=True)

    def _collective(self, what: str, collective, *args, watched: bool = True, **kwargs):
        """`watched`: the watch thread fails the group if this takes longer than the collectives' timeout."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        self._busy = (what, time.monotonic()) if watched else None
        try:
            return collective(*args, **kwargs)
        except RuntimeError as exc:
            raise self.fail(f"{what} failed: {_first_words(exc)}") from exc
        except BaseException:  # e.g. Ctrl-C: the other ranks are left mid-collective, out of step for good
            self.fail(f"{what} was interrupted")
            raise
        finally:
            self._busy = None

    # --- failure and shutdown ---
    def fail(self, reason: str) -> TensorParallelError:
        """Stop the whole group: the ranks are out of step and cannot compute again."""
        with self._lock:
            if self.failure is None and not self._stopped:
                time.sleep(WATCH_INTERVAL_S)  # a rank that just died is reaped and its exit code known
                statuses = rank_statuses(self.workers) + worker_error(self.workers)
                self.failure = f"tensor parallelism stopped ({self.size} ranks): {statuses}; {reason}"
                log.error("%s", self.failure)
                stop_workers(self.workers, grace_s=0)
                for callback in self.on_failure:
                    callback(self.failure)
        return TensorParallelError(self.failure or "the tensor-parallel model was stopped")

    def _watch(self) -> None:
        """A worker that ends while the model is in use stops the group, even between steps; so does a collective
        that has waited longer than the timeout (messages to the other ranks have no timeout of their own)."""
        limit = COLLECTIVE_TIMEOUT.total_seconds()
        while not self._stopped and self.failure is None:
            workers = self.workers.processes if self.workers is not None else []
            busy = self._busy
            if any(process.exitcode is not None for process in workers) and not self._stopped:
                self.fail("a worker ended while the model was in use")
            elif busy is not None and time.monotonic() - busy[1] > limit + WATCH_INTERVAL_S:
                self.fail(f"{busy[0]} took more than {limit:.0f} s")
            time.sleep(WATCH_INTERVAL_S)

    def stop(self) -> None:
        """Tell the workers to end, wait for them, and close the process group (also run at exit)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.failure is None:
                self.send(("stop",))
        except TensorParallelError:
            pass
        finally:
            stop_workers(self.workers, grace_s=STOP_GRACE_S)
            self._remove_shared_file()
            if dist.is_initialized():
                dist.destroy_process_group()
            self.failure = self.failure or "the tensor-parallel model was stopped"


class MirroredMemory:
    """Rank 0's memory: every call that changes it is repeated on the other ranks' memories."""

    def __init__(self, memory, leader: Leader, memory_id: int, sizes: dict) -> None:
        self._memory, self._leader, self._id = memory, leader, memory_id
        leader.send(("memory", memory_id, sizes))  # now: the other ranks allocate their caches before the first step
        weakref.finalize(self, leader.record, ("drop", memory_id))

    def __getattr__(self, name: str):
        attribute = getattr(self._memory, name)
        return functools.partial(self._mirrored, name, attribute) if name in MUTATING else attribute

    def _mirrored(self, name: str, method, *args, **kwargs):
        result = method(*args, **kwargs)  # a call that raises changed nothing: no rank repeats it
        self._leader.record(("call", self._id, name, args, kwargs))
        return result

    def state_seq_save(self, seq_id: int) -> bytes:
        """Every rank's part (its KV heads), gathered: loadable only by a model with as many ranks."""
        own = self._memory.state_seq_save(seq_id)  # a bad seq_id raises here, before any other rank is asked
        self._leader.send(("save", self._id, seq_id))
        return pack_parts(self._leader.gather(own))

    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None:
        parts = unpack_parts(data, self._leader.size)
        for part in parts[1:]:
            check_state(self._memory.pools, part)  # every rank's part, so that no other rank can refuse its own
        self._memory.state_seq_load(parts[0], dest_seq_id)  # on error nothing changed anywhere
        self._leader.record(("load", self._id, parts, dest_seq_id))


class LeaderDecoder:
    """Rank 0's decoder: each forward pass is first announced to the other ranks, who run it alongside."""

    def __init__(self, decoder, leader: Leader) -> None:
        self._decoder, self._leader = decoder, leader
        leader.connect(decoder)

    def __getattr__(self, name: str):
        return getattr(self._decoder, name)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv, output_rows=None, with_hidden=False):
        # (on the host: a GPU tensor would unpickle onto rank 0's GPU; the other ranks' hidden states are not needed)
        self._leader.send(("forward", tokens.cpu(), positions, None if output_rows is None else output_rows.cpu()))
        try:
            return self._decoder.forward(tokens, positions, kv, output_rows, with_hidden)
        except TensorParallelError:
            raise
        except Exception as exc:
            raise self._leader.fail(f"rank 0's forward pass failed ({type(exc).__name__}: {exc}), so the other "
                                    f"ranks' passes cannot finish") from exc
        except BaseException:  # Ctrl-C: the other ranks' passes cannot finish either
            self._leader.fail("rank 0's forward pass was interrupted")
            raise


def _first_words(exc: Exception) -> str:
    """gloo's message without its source location, first sentence only."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip()).splitlines()[0]
    return text.split(". ")[0][:160]


def pack_parts(parts: list[bytes]) -> bytes:
    """A saved sequence of a tensor-parallel model: each rank's state, in rank order."""
    header = STATE_MAGIC + struct.pack(f"<I{len(parts)}Q", len(parts), *(len(part) for part in parts))
    return header + b"".join(parts)


def unpack_parts(data: bytes, size: int) -> list[bytes]:
    if data[:4] != STATE_MAGIC:
        raise ValueError(f"this state was not saved by a tensor-parallel model; this one has {size} ranks")
    (n_parts,) = struct.unpack_from("<I", data, 4)
    if n_parts != size:
        raise ValueError(f"this state was saved by a model on {n_parts} ranks; this one has {size}")
    lengths = struct.unpack_from(f"<{size}Q", data, 8)
    start = 8 + 8 * size
    if start + sum(lengths) != len(data):
        raise ValueError(f"the state is {len(data)} bytes; its header promises {start + sum(lengths)}")
    offsets = list(itertools.accumulate(lengths, initial=start))
    return [data[a:b] for a, b in zip(offsets, offsets[1:])]
