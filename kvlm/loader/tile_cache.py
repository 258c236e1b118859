"""A model's matrices kept on disk in the native products' tiles, so that its next start maps them instead of reading
the file and rearranging every matrix again.

A load reads each block matrix the native products take in interleaved tiles (kvlm/kernels/csrc/tiles.h) into
fresh memory and rearranges it there: of a 7B-shaped Q4_K_M file's 2.8 s warm load, 1.4 s went to the fresh pages,
0.4 s to the reads and 0.6 s to the rearranging (a Zen 5 VM; mapping a file of that size from the page cache takes
0.2-0.45 s). So after a load that rearranged MIN_BYTES or more, one niced thread writes the tiles into one file,
DIR/<digest>.tiles, and the next load of the same file with the same kernels maps it and takes every matrix from it
as it is. The map is private (a write would copy its page, never reach the file) and populated in one call: its
pages are the page cache's, shared with other processes mapping the same file.

The digest covers what the tiles' bytes depend on: the model's files (path, size, modification and change times,
inode; a folder's config.json too), the native library (its build key: its sources, compiler and CPU), kvlm's Python
code and the tensor-parallel rank. Inside, each entry is a tensor's part (name, rows, columns) and is taken only
where its type, width and bytes are what the model's file says. A file is written whole under another name, flushed
to disk and renamed into place, so a reader never sees part of one; one whose header is damaged is deleted, one
that cannot be read or mapped is left alone. A tensor-parallel worker rank writes its file before its load returns
(rank 0 may end it soon after a stop). The directory is kept within its size (least recently used files first, by
modification time, which a load that maps a file renews), and a file is written only where the disk keeps RESERVE
free beside it (other files deleted for that only where that is enough).

`KVLM_TILE_CACHE`: the directory (default $KVLM_HOME/tiles), or "0"/"off" for none; `KVLM_TILE_CACHE_SIZE`: its
bound (default 32G). A failed write is a warning; the load it follows has already succeeded.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from kvlm.home import kvlm_home
from kvlm.kernels import BlockMatrix
from kvlm.loader.gguf_reader import private_map
from kvlm.loader.memory_plan import parse_size
from kvlm.loader.tensors import Entry, Stored
from kvlm.startup import niced_writer

log = logging.getLogger("kvlm")

DIRECTORY_VARIABLE, SIZE_VARIABLE = "KVLM_TILE_CACHE", "KVLM_TILE_CACHE_SIZE"
DEFAULT_SIZE = "32G"
MIN_BYTES = 128 << 20  # below this a model's tiles are made faster than a file of them pays for its disk
RESERVE = 2 << 30  # free disk left beside a file written
MAGIC = b"KVLMTILES1\n"
PAGE = mmap.PAGESIZE
SUFFIX = ".tiles"
STALE_PARTIAL_S = 3600  # a file being written this long ago was left by a process that ended
WRITER = niced_writer("kvlm-tiles")
# What reading a damaged header raises (JSON's errors are ValueErrors).
DAMAGED = (ValueError, KeyError, TypeError, AttributeError, OverflowError, MemoryError, struct.error)


def tile_cache_for(files: list[Path], kernels_key: str, rank: tuple[int, int]) -> TileCache | None:
    """The tile cache of a model stored in `files`, for the native library whose build key is `kernels_key`, as
    tensor-parallel rank `rank` (index, size) reads it; None where KVLM_TILE_CACHE turns it off."""
    folder = cache_directory()
    if folder is None:
        return None
    limit = parse_size(os.environ.get(SIZE_VARIABLE) or DEFAULT_SIZE)
    return TileCache(folder / (_digest(files, kernels_key, rank) + SUFFIX), limit, files=files)


def cache_directory() -> Path | None:
    """Where tiles files are kept, as KVLM_TILE_CACHE says; None for nowhere."""
    where = os.environ.get(DIRECTORY_VARIABLE, "")
    if where.lower() in ("0", "off", "none", "false"):
        return None
    return Path(where).expanduser() if where else kvlm_home() / "tiles"


def _digest(files: list[Path], kernels_key: str, rank: tuple[int, int]) -> str:
    digest = hashlib.sha256(MAGIC + f"{kernels_key}\n{rank}\n".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\n{stat.st_size}\n{stat.st_mtime_ns}\n{stat.st_ctime_ns}\n{stat.st_ino}\n"
                      .encode())
    digest.update(_code_digest())
    return digest.hexdigest()[:32]


@lru_cache(maxsize=1)
def _code_digest() -> bytes:
    """kvlm's Python source: what reads a file's tensors into blocks (the loader, the families' renames, permuted
    rows and fused parts, which matrices are tiled) is spread over it, so any change to it makes new tiles."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.parent.rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.digest()


class TileCache:
    """One model's tiles: those its file holds (mapped), and those this load made (written by `save`)."""

    def __init__(self, path: Path, limit: int, min_bytes: int | None = None, files: Sequence[Path] = ()) -> None:
        self.path, self.limit = path, limit
        self.files = [str(file.resolve()) for file in files]  # the model's, named in the file (kvlm ls, kvlm rm)
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.mapped = MappedTiles.open(path)
        self.kept: dict[str, BlockMatrix] = {}  # every tiled matrix this load gave, for the file
        self.made_bytes = 0  # of those, the bytes made rather than mapped
        self.saved: Future | None = None  # the write of the file, once `save` started it

    def read(self, part: tuple[str, slice | None, slice | None], expected: Entry, make: Callable[[], Stored]) -> Stored:
        """The tensor's part (name, rows, columns) in tiles: from the file where it holds it, else `make()`."""
        key = entry_key(*part)
        found = self.mapped.get(key, expected) if self.mapped is not None else None
        value = found if found is not None else make()
        if isinstance(value, BlockMatrix) and value.interleaved:
            self.kept[key] = value
            self.made_bytes += 0 if found is not None else value.nbytes
        return value

    def save(self) -> int:
        """After the load: where it made MIN_BYTES or more of tiles, the writer thread writes every tiled matrix it
        gave into the file (`saved`); the bytes it writes (0: none)."""
        kept, self.kept = self.kept, {}
        nbytes = sum(m.nbytes for m in kept.values())
        if not self.made_bytes or nbytes < self.min_bytes:
            return 0
        self.saved = WRITER.submit(write_tiles, self.path, kept, self.limit, self.files)
        return nbytes


def entry_key(name: str, rows: slice | None, cols: slice | None) -> str:
    span = lambda s: "" if s is None else f"{s.start}:{s.stop}"  # noqa: E731
    return f"{name}[{span(rows)}][{span(cols)}]"


class MappedTiles:
    """A tiles file, mapped: its header (MAGIC, the index's length, the index as JSON: the model's files, and its
    entries, key -> [offset, rows, row bytes, GGML type, columns]), then each matrix's bytes at a page boundary."""

    def __init__(self, path: Path, index: dict[str, list[int]], mapped: mmap.mmap) -> None:
        self.path, self.index, self.map = path, index, mapped

    @classmethod
    def open(cls, path: Path) -> MappedTiles | None:
        """The file mapped (its pages populated in one call), or None where there is none, it cannot be read
        (said, and left alone) or it is not sound (said, and deleted). The map is never closed: the matrices' tensors
        point into it, and it goes when the last of them does."""
        try:
            with path.open("rb") as file:
                _, index = _read_header(file, path.stat().st_size)
                mapped = private_map(file.fileno(), 0, path.stat().st_size)
        except FileNotFoundError:
            return None
        except OSError as exc:  # (permissions, address space: the file may be sound)
            log.warning("tile cache: %s not used: %s", path.name, exc)
            return None
        except DAMAGED as exc:
            log.warning("tile cache: %s not used and deleted: %s", path.name, exc)
            with contextlib.suppress(OSError):  # (a folder of someone else's, or read-only)
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # (recently used)
        return cls(path, index, mapped)

    def get(self, key: str, expected: Entry) -> BlockMatrix | None:
        """The entry's matrix, interleaved, where the file holds it as the model's file says it is."""
        found = self.index.get(key)
        if found is None:
            return None
        offset, rows, row_bytes, qtype, n_cols = found
        if (GGMLQuantizationType(qtype).name != expected.stored_as or rows * row_bytes != expected.nbytes
                or n_cols != expected.shape[-1]):
            return None
        blocks = torch.frombuffer(self.map, dtype=torch.uint8, count=rows * row_bytes, offset=offset)
        return BlockMatrix(blocks.view(rows, row_bytes), GGMLQuantizationType(qtype), n_cols, interleaved=True)


def _read_header(file, size: int) -> tuple[list[str], dict[str, list[int]]]:
    """(the model's files, the entries) of an open tiles file of `size` bytes, every entry checked to lie inside."""
    if file.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a tiles file of this version")
    (length,) = struct.unpack("<Q", file.read(8))
    if length > size:
        raise ValueError(f"its header claims {length} bytes of a {size}-byte file")
    header = json.loads(file.read(length))
    files, index = [str(f) for f in header["files"]], dict(header["entries"])
    for offset, rows, row_bytes, qtype, _ in index.values():
        GGMLQuantizationType(qtype)
        if offset % PAGE or offset + rows * row_bytes > size:
            raise ValueError(f"an entry at {offset}..{offset + rows * row_bytes} is not inside the file ({size} bytes)")
    return files, index


def write_tiles(path: Path, matrices: dict[str, BlockMatrix], limit: int, files: Sequence[str] = ()) -> bool:
    """(On the writer thread.) The matrices into `path`, written whole beside it and renamed into place, after the
    directory's least recently used files made room within `limit`; False (said in the log) where it did not fit or
    could not be written. `files`: the model's, named in the header."""
    index, offset = {}, 0
    for key, matrix in matrices.items():
        index[key] = [offset, matrix.shape[0], matrix.blocks.shape[1], int(matrix.qtype), matrix.n_cols]
        offset += _page_up(matrix.nbytes)
    # The matrices start after the index, whose offsets then grow by that start: room for 20 more digits each.
    start = _page_up(len(MAGIC) + 8 + len(json.dumps({"files": files, "entries": index})) + 20 * len(index))
    for entry in index.values():
        entry[0] += start
    head = json.dumps({"files": files, "entries": index}).encode()
    total = start + offset
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not _make_room(path, total, limit):
            return False
        with partial.open("wb") as file:
            file.write(MAGIC + struct.pack("<Q", len(head)) + head)
            for matrix, (entry_offset, *_) in zip(matrices.values(), index.values()):
                file.seek(entry_offset)
                file.write(memoryview(matrix.blocks.contiguous().numpy()).cast("B"))
            file.truncate(total)
            file.flush()
            os.fsync(file.fileno())  # (a file renamed into place is whole after a crash too: nothing checks its bytes)
        os.replace(partial, path)
    except OSError as exc:
        log.warning("tile cache: %s not written (%s); the next start reads the model's file again", path, exc)
        with contextlib.suppress(OSError):  # (there may be none, or no directory to hold one)
            partial.unlink()
        return False
    log.info("tile cache: %s written (%.0f MiB of tiles for the next start)", path, total / 2**20)
    return True


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _make_room(path: Path, nbytes: int, limit: int) -> bool:
    """Deletes the directory's least recently used tiles files until `nbytes` more fit within `limit`; False where
    they cannot, or where the disk would keep less than RESERVE free."""
    if nbytes > limit:
        log.info("tile cache: %s not written: %.0f MiB of tiles exceed the cache's %.0f MiB (%s)", path.name,
                 nbytes / 2**20, limit / 2**20, SIZE_VARIABLE)
        return False
    free, files = shutil.disk_usage(path.parent).free, []
    for other in path.parent.iterdir():
        try:
            stat = other.stat()
        except FileNotFoundError:  # (another process deleted it meanwhile)
            continue
        if other.name.endswith(".partial") and time.time() - stat.st_mtime > STALE_PARTIAL_S:
            other.unlink(missing_ok=True)
        elif other.suffix == SUFFIX and other != path:
            files.append((stat.st_mtime_ns, stat.st_size, other))
    held = sum(size for _, size, _ in files)
    if free + held < nbytes + RESERVE:  # (not even with every other tiles file gone: delete none)
        log.info("tile cache: %s not written: the disk has less than %.0f MiB free beside it", path.name,
                 (nbytes + RESERVE) / 2**20)
        return False
    for _, size, other in sorted(files):  # least recently used first, until within the limit and the disk's reserve
        if held + nbytes <= limit and free >= nbytes + RESERVE:
            break
        other.unlink(missing_ok=True)  # (a process mapping it keeps its pages)
        held, free = held - size, free + size
    return True


@dataclass(frozen=True)
class KeptTiles:
    """A tiles file in the cache: for `kvlm ls` and `kvlm rm`."""

    path: Path
    size: int
    files: tuple[str, ...]  # the model's files it was made from (resolved paths)


def kept_tiles() -> list[KeptTiles]:
    """Every sound tiles file in the cache directory."""
    folder = cache_directory()
    kept = []
    for path in sorted(folder.glob("*" + SUFFIX)) if folder is not None and folder.is_dir() else []:
        try:
            with path.open("rb") as file:
                files, _ = _read_header(file, path.stat().st_size)
        except (OSError, *DAMAGED):
            continue
        kept.append(KeptTiles(path, path.stat().st_size, tuple(files)))
    return kept


def tiles_of(model_files: list[Path], kept: list[KeptTiles] | None = None) -> list[KeptTiles]:
    """The tiles files made from any of these model files."""
    resolved = {str(Path(file).resolve()) for file in model_files}
    return [tiles for tiles in (kept_tiles() if kept is None else kept) if resolved & set(tiles.files)]
