"""Models kept on disk as loaded: a second start maps them back instead of reading and packing the file again.

Reading a GGUF file and repacking its weights for this CPU's kernels takes seconds (the gguf reader alone
parses every vocabulary string as a NumPy view); a packed model saved with torch.save and loaded with
mmap is ready in a fraction of that. An entry is only reused for the same file (path, size, modification
time), the same compute settings, the same torch, CPU kernel level and kvlm source; anything else is a miss.
The cache lives in $KVLM_HOME/packed and keeps the newest few entries. It holds pickled objects written by
this code: only files kvlm itself wrote there are ever loaded.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from kvlm.fetch import kvlm_home
from kvlm.model.cpu import detect
from kvlm.model.settings import ComputeSettings

log = logging.getLogger("kvlm")

KEEP_ENTRIES = 3
SWITCH_VARIABLE = "KVLM_PACK_CACHE"  # "0" turns the cache off


def enabled() -> bool:
    return os.environ.get(SWITCH_VARIABLE, "1") != "0"


def cache_dir() -> Path:
    return kvlm_home() / "packed"


def entry_path(source: Path, settings: ComputeSettings) -> Path:
    return cache_dir() / f"{_key(source, settings)}.pt"


def load(source: Path, settings: ComputeSettings):
    """The cached objects for this file and settings, or None (a damaged or stale entry is a miss)."""
    path = entry_path(source, settings)
    if not enabled() or not path.is_file():
        return None
    try:
        return torch.load(path, mmap=True, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, never fatal
        log.warning("ignoring the packed-model cache entry %s: %s", path, exc)
        return None


def save(source: Path, settings: ComputeSettings, objects) -> None:
    """Write atomically; a full disk or a read-only cache only costs the next start its speed."""
    if not enabled():
        return
    path = entry_path(source, settings)
    partial = path.with_suffix(".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(objects, partial)
        os.replace(partial, path)
        _evict_old(keep=path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink()
        log.warning("could not write the packed-model cache entry %s: %s", path, exc)


def _evict_old(keep: Path) -> None:
    entries = sorted(cache_dir().glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in entries if p != keep][KEEP_ENTRIES - 1:]:
        old.unlink(missing_ok=True)


def _key(source: Path, settings: ComputeSettings) -> str:
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    stamps = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    parts = [*stamps, repr(settings), torch.__version__, detect().kernel_level, _source_digest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@lru_cache(maxsize=1)
def _source_digest() -> str:
    """kvlm's own code: a cached object only comes back into the classes that pickled it."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
