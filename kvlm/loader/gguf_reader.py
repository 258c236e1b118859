"""Reading a GGUF file: its metadata, its tensor table, and each tensor's bytes.

Written for kvlm rather than taken from `gguf`'s GGUFReader, which builds a NumPy view for every part of every
metadata value (seconds for a 150k-token vocabulary) and maps the tensors' data into the process. Here the header is
parsed in one pass through a memory map, and a tensor's bytes are read (pread) straight into the memory that will
hold them, so reading a model one tensor at a time holds no more of the file than the tensors already read; bytes
kept as they are stored are mapped instead (`mapped`: a private map of their own, gone with them), so they are the
page cache's pages rather than a copy.

Format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic "GGUF", version, tensor count, key/value
count; the key/values; the tensor infos (name, dimensions innermost first, type, offset); padding to the alignment;
the tensors' data.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvlm.core.errors import ModelFileError

MAGIC = b"GGUF"
READ_BYTES = 64 << 20  # per read call
DEFAULT_ALIGNMENT = 32
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python names it from 3.13
# GGUF value types: their struct codes (numbers), or the names of the two that are not numbers.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: outermost first ([out, in] for a matrix)
    qtype: GGMLQuantizationType
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buffer, path: Path) -> None:
        self.buffer, self.at, self.path = buffer, 0, path

    def unpack(self, code: str) -> Any:
        value = struct.unpack_from("<" + code, self.buffer, self.at)[0]
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        raw = bytes(self.buffer[self.at:self.at + length])
        if len(raw) != length:
            raise struct.error("a string runs past the end of the file")
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ModelFileError(f"{self.path}: not a readable GGUF file (unknown value type {kind} at byte {self.at})")

    def array(self) -> list:
        kind, count = self.unpack("I"), self.unpack("Q")
        if kind in _NUMPY:  # numbers in one go: a vocabulary's scores or token types are 100k+ values
            dtype = np.dtype(_NUMPY[kind]).newbyteorder("<")
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.at)
            self.at += values.nbytes
            return values.tolist()
        if kind == _STRING:
            return self.strings(count)
        return [self.value(kind) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges): the loop kept tight, 300k of them take 0.2 s."""
        buffer, at, out = self.buffer, self.at, []
        length_at = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = length_at(buffer, at)
            out.append(str(buffer[at + 8:at + 8 + length], "utf-8", "replace"))
            at += 8 + length
        if at > len(buffer):
            raise struct.error("a string runs past the end of the file")
        self.at = at
        return out


class GGUFFile:
    """An open GGUF file: `metadata`, `tensors` (by name, in file order) and each tensor's bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ModelFileError(f"{self.path}: no such GGUF file") from None
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ModelFileError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError) as exc:
            raise ModelFileError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        cursor = _Cursor(self._map, self.path)
        if bytes(self._map[:4]) != MAGIC:
            raise ModelFileError(f"{self.path}: not a readable GGUF file (it does not start with {MAGIC!r})")
        cursor.at = 4
        version, n_tensors, n_values = cursor.unpack("I"), cursor.unpack("Q"), cursor.unpack("Q")
        if version < 2:
            raise ModelFileError(f"{self.path}: not a readable GGUF file (version {version}; 2 and later are read)")
        metadata = {}
        for _ in range(n_values):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("I"))
        infos = [self._tensor_info(cursor) for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.at // alignment) * alignment
        tensors = {}
        for name, shape, qtype, offset in infos:
            info = TensorInfo(name, shape, qtype, data_start + offset, _tensor_bytes(shape, qtype))
            self.check_complete(info)
            tensors[name] = info
        return metadata, tensors

    def _tensor_info(self, cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cursor.string()
        dims = [cursor.unpack("Q") for _ in range(cursor.unpack("I"))]
        kind = cursor.unpack("I")
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ModelFileError(f"{self.path}: tensor {name} has unknown type {kind}") from None
        return name, tuple(reversed(dims)), qtype, cursor.unpack("Q")

    @property
    def size(self) -> int:
        return len(self._map)

    @property
    def paths(self) -> list[Path]:
        return [self.path]

    def read_into(self, out, offset: int) -> None:
        """The file's bytes from `offset` into `out` (a contiguous tensor or array: as many bytes as it holds)."""
        view = memoryview(out.numpy() if hasattr(out, "numpy") else out).cast("B")
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:done + READ_BYTES]], offset + done)
                if n <= 0:
                    raise ModelFileError(f"{self.path}: the file ends before byte {offset + len(view)}")
                done += n

    def mapped(self, offset: int, nbytes: int) -> torch.Tensor:
        """The file's bytes offset .. offset + nbytes as a uint8 tensor over a private map of them of its own (a
        write would copy its page, never reach the file), unmapped when the tensor goes."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as f:
            pages = private_map(f.fileno(), start, offset + nbytes - start)
        return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes, offset=offset - start)

    def check_complete(self, info: TensorInfo) -> None:
        if info.offset + info.nbytes > self.size:
            raise ModelFileError(
                f"{self.path}: tensor {info.name} needs bytes {info.offset}..{info.offset + info.nbytes} but the "
                f"file has {self.size} (it is truncated or damaged)")

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the map goes when that does
            pass


def private_map(fd: int, offset: int, length: int) -> mmap.mmap:
    """A private map of a file's bytes offset .. offset + length (copy on write: the page cache's pages, shared, until
    one is written), its pages mapped in one call rather than faulted in one by one as they are first read."""
    pages = mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=offset)
    try:
        pages.madvise(MADV_POPULATE_READ)
    except OSError:  # a kernel before 5.14: the pages come in as they are first read
        pass
    return pages


def _tensor_bytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block_weights * block_bytes


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value of a GGUF file as str, int, float, bool or lists of those."""
    gguf = GGUFFile(path)
    metadata = gguf.metadata
    gguf.close()
    return metadata
