"""Prefix cache tiers beyond the cell pool: whole sequence states kept in RAM and on disk, after llama.cpp's
--cache-ram (its server's prompt cache).

When a request ends, its sequence (every K/V row and recurrent state of the tokens computed: prompt and output but
the last) is saved in the sequence-state format (kvlm.memory.seq_state) to each tier. A later request whose prompt
starts with an entry's tokens loads the entry into its sequence instead of computing them, when that is more than
the cell pool's prefix cache (kvlm.engine.prefix_cache, state_checkpoints) holds of it by a block or more. A memory
of K/V cells alone (unified, iSWA) may also take the part of an entry its prompt shares, cutting the rest away
(iSWA: where the window before the cut is still whole); one with recurrent states only a whole entry (a state holds
its whole sequence and cannot be cut back), so for those the engine also saves the state at the prompt's last block
boundary (its kept copy), which a next prompt carrying another reply than the one computed still starts with.

Each tier is bounded in bytes and evicts its least recently used entry first. The disk tier writes every entry
(the RAM tier keeps a copy in front of it; a thread of its own writes the files while the engine goes on, and
finishes them before the process exits) under DIR/<fingerprint>/, where the fingerprint covers everything that
changes a state's bytes: the model file, the computing settings and backend, the KV dtype, RoPE, kvlm's state
format. A restarted process with the same settings finds the previous one's entries there. Entries carry a CRC32
and their fingerprint; one that is corrupt, truncated or another's is logged once, deleted and never loaded. A
directory that cannot be written (or a full disk) turns the disk tier off with a warning; no request fails for it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kvlm.memory.seq_state import (VERSION, StateError, blob_checksum, blob_head, decode_state, model_identity,
                                   peek_header)
from kvlm.startup import niced_writer

log = logging.getLogger("kvlm")

SUFFIX = ".kvprefix"
STALE_PARTIAL_S = 600  # an entry file being written this long ago was left by a process that ended
TIER_FORMAT = 1  # of the entry files around the sequence states (their header's fields)


# Writes and deletes the disk tiers' files in order, off the engine's thread, niced; at exit, what it was given is
# finished.
WRITER = niced_writer("kvlm-prefix-disk")


def fingerprint(model, kv_dtype: str) -> str:
    """A digest of everything a saved state's bytes depend on (the file by path, size and modification time)."""
    decoder = model.decoder
    settings = {k: v for k, v in dataclasses.asdict(decoder.settings).items() if k != "reason"}
    kernels = getattr(decoder.ops, "kernels", None)
    facts = {"tier_format": TIER_FORMAT, "state_format": VERSION, "model": model_identity(model.config),
             "files": _file_identity(Path(model.source)), "settings": settings, "backend": decoder.ops.name,
             "isa": getattr(kernels, "isa", None), "kv_dtype": kv_dtype, "rope": str(model.config.rope)}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _file_identity(source: Path) -> list:
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.exists()]


@dataclass
class TierEntry:
    tokens: np.ndarray            # int64: what the saved positions 0 .. n - 1 hold
    n_bytes: int                  # what it takes in its tier (the state; on disk, its file)
    data: bytes | None = None     # the sequence state (RAM tier)
    path: Path | None = None      # its file (disk tier)

    @property
    def key(self) -> str:
        return hashlib.sha256(self.tokens.astype("<i8").tobytes()).hexdigest()[:32]


@dataclass
class TierStats:
    queries: int = 0     # lookups of a prompt
    hits: int = 0        # lookups that loaded an entry of this tier
    hit_tokens: int = 0  # positions those loads gave


class Tier:
    """Entries by key, least recently used first, within `capacity` bytes."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the {name} tier's size must be >= 0 bytes, got {capacity}")
        self.name, self.capacity = name, capacity
        self.entries: OrderedDict[str, TierEntry] = OrderedDict()
        self.stats = TierStats()

    @property
    def n_bytes(self) -> int:
        return sum(entry.n_bytes for entry in self.entries.values())

    def add(self, entry: TierEntry) -> bool:
        if entry.n_bytes > self.capacity:
            return False
        self.entries[entry.key] = entry
        self.entries.move_to_end(entry.key)
        while self.n_bytes > self.capacity:
            self.remove(next(iter(self.entries.values())))
        return True

    def remove(self, entry: TierEntry) -> None:
        self.entries.pop(entry.key, None)

    def read(self, entry: TierEntry) -> bytes:
        self.entries.move_to_end(entry.key)
        return entry.data


class DiskTier(Tier):
    """Entry files in a directory: the sequence state inside a state-format envelope holding the fingerprint and
    the tokens (a header read without the body lists them at start). Files are written and deleted by one thread
    of the process (WRITER), in order, while the engine goes on; the index is the engine thread's."""

    def __init__(self, folder: Path, capacity: int, fingerprint: str) -> None:
        super().__init__("disk", capacity)
        self.folder, self.fingerprint = folder, fingerprint
        self.failure: OSError | None = None  # the last write's error, if it failed
        self._writes: dict[Path, Future] = {}
        WRITER.submit(lambda: None).result()  # (this process may have entries for this folder still being written)
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_bytes(b"")  # (an unwritable directory fails here, before any request)
        probe.unlink()
        found = []
        for path in folder.glob("*.partial"):  # left by a process that ended while writing (not one writing now)
            if time.time() - path.stat().st_mtime > STALE_PARTIAL_S:
                path.unlink(missing_ok=True)
        for path in folder.glob("*" + SUFFIX):
            try:
                found.append((path.stat().st_mtime_ns, self._indexed(path)))
            except (OSError, StateError, ValueError, KeyError) as exc:
                self._discard(path, exc)
        for _, entry in sorted(found, key=lambda pair: pair[0]):
            super().add(entry)

    def add(self, entry: TierEntry) -> bool:
        head = blob_head({"fingerprint": self.fingerprint, "tokens": entry.tokens.tolist()}, len(entry.data))
        size = len(head) + len(entry.data) + 4
        if size > self.capacity:
            return False
        path = self.folder / (entry.key + SUFFIX)
        self._writes = {p: f for p, f in self._writes.items() if not f.done()}
        self._writes[path] = WRITER.submit(self._write, path, head, entry.data)
        return super().add(TierEntry(entry.tokens, size, path=path))

    def _write(self, path: Path, head: bytes, data: bytes) -> None:
        """(On the writer thread.) A crash leaves a .partial file behind, never half an entry."""
        partial = path.with_suffix(f".{os.getpid()}.partial")  # (processes sharing the directory)
        try:
            with partial.open("wb") as file:
                file.write(head)
                file.write(data)
                file.write(blob_checksum(head, data))
            os.replace(partial, path)
        except OSError as exc:
            self.failure = exc
            partial.unlink(missing_ok=True)

    def flush(self) -> None:
        WRITER.submit(lambda: None).result()

    def remove(self, entry: TierEntry) -> None:
        super().remove(entry)
        WRITER.submit(entry.path.unlink, missing_ok=True)  # (after its write, if that is still to come)

    def read(self, entry: TierEntry) -> bytes | None:
        """The entry's state, checked (CRC32, fingerprint, tokens); None if it is not sound (then deleted)."""
        writing = self._writes.pop(entry.path, None)
        if writing is not None:
            writing.result()
        try:
            header, _, parts = decode_state(entry.path.read_bytes(), {"fingerprint": self.fingerprint})
            if header["tokens"] != entry.tokens.tolist():
                raise StateError("its tokens are not those of its index entry")
        except (OSError, StateError, ValueError, KeyError) as exc:
            super().remove(entry)
            self._discard(entry.path, exc)
            return None
        os.utime(entry.path)  # least recently used by modification time, across restarts too
        super().read(entry)
        return parts[0].numpy().tobytes()

    def _indexed(self, path: Path) -> TierEntry:
        with path.open("rb") as file:
            header = peek_header(file)
        if header["fingerprint"] != self.fingerprint:
            raise StateError("saved with other model settings (fingerprint mismatch)")
        entry = TierEntry(np.asarray(header["tokens"], dtype=np.int64), path.stat().st_size, path=path)
        if path.name != entry.key + SUFFIX:
            raise StateError("its name is not its tokens' key")
        return entry

    @staticmethod
    def _discard(path: Path, why: Exception) -> None:
        log.warning("prefix cache disk tier: %s skipped and deleted: %s", path.name, why)
        path.unlink(missing_ok=True)


@dataclass
class TierHit:
    tier: Tier
    entry: TierEntry
    n_tokens: int  # positions of the entry the prompt can use


class PrefixTiers:
    def __init__(self, fingerprint: str, ram_bytes: int = 0, disk_dir: str | Path | None = None,
                 disk_bytes: int = 0, partial: bool = True, block_size: int = 16) -> None:
        """`partial`: whether a prompt may use part of an entry (K/V cells alone: no recurrent state); `block_size`: the
        prefix cache's, the shortest sequence worth saving and the least gain worth loading one."""
        self.partial, self.block_size = partial, block_size
        self.tiers: list[Tier] = [Tier("ram", ram_bytes)] if ram_bytes else []
        if disk_dir is not None and disk_bytes:
            try:
                self.tiers.append(DiskTier(Path(disk_dir).expanduser() / fingerprint, disk_bytes, fingerprint))
            except OSError as exc:
                log.warning("prefix cache: no disk tier (%s cannot be written: %s)", disk_dir, exc)

    def tier(self, name: str) -> Tier | None:
        return next((tier for tier in self.tiers if tier.name == name), None)

    def save(self, tokens: list[int], state: Callable[[], bytes]) -> None:
        """Keep a sequence's state (positions 0 .. len(tokens) - 1; `state()` gives it) in every tier that lacks
        it (the same tokens again are the same bytes: kept, as the most recently used)."""
        self._drop_failed()
        entry = TierEntry(np.asarray(tokens, dtype=np.int64), 0)
        lacking = []
        for tier in self.tiers:
            if entry.key in tier.entries:
                tier.entries.move_to_end(entry.key)
            else:
                lacking.append(tier)
        if lacking:
            entry.data = state()
            entry.n_bytes = len(entry.data)
            for tier in lacking:
                tier.add(entry)

    def flush(self) -> None:
        """Wait until the disk tier's files are written (a tier whose writes failed is dropped)."""
        for tier in self.tiers:
            if isinstance(tier, DiskTier):
                tier.flush()
        self._drop_failed()

    def _drop_failed(self) -> None:
        for tier in list(self.tiers):
            failure = getattr(tier, "failure", None)
            if failure is not None:  # a full disk, a directory gone: no disk tier from now on
                log.warning("prefix cache: the %s tier is off (%s)", tier.name, failure)
                self.tiers.remove(tier)

    def find(self, tokens: list[int], limit: int) -> TierHit | None:
        """The entry giving the most of `tokens`' first `limit` positions (the nearest tier's on a tie)."""
        prompt = np.asarray(tokens[:limit], dtype=np.int64)
        best = None
        for tier in self.tiers:
            tier.stats.queries += 1
            for entry in tier.entries.values():
                n = self._usable(entry.tokens, prompt)
                if n and (best is None or n > best.n_tokens):
                    best = TierHit(tier, entry, n)
        return best

    def read(self, hit: TierHit) -> bytes | None:
        return hit.tier.read(hit.entry)

    def loaded(self, hit: TierHit) -> None:
        hit.tier.stats.hits += 1
        hit.tier.stats.hit_tokens += hit.n_tokens

    def drop(self, hit: TierHit, why: Exception) -> None:
        log.warning("prefix cache %s tier: an entry of %d tokens could not be loaded and is dropped: %s",
                    hit.tier.name, len(hit.entry.tokens), why)
        hit.tier.remove(hit.entry)

    def _usable(self, saved: np.ndarray, prompt: np.ndarray) -> int:
        n = min(len(saved), len(prompt))
        differ = np.flatnonzero(saved[:n] != prompt[:n])
        shared = int(differ[0]) if len(differ) else n
        return shared if shared == len(saved) or self.partial else 0
