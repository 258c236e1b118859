"""A model file's tensors, read one at a time: what the file stores, under GGUF names, in torch's layout.

`read(name, rows, cols)` returns a 2-D tensor of a block format kvlm's kernels read as a `BlockMatrix` (the
file's bytes, copied out of the map), and anything else as a dense tensor in the file's own float dtype (float32
for other quantized formats, dequantized by gguf). `rows` and `cols` select a part (a tensor-parallel shard), so
only that part is ever read. Pages of the file a read touched are released once copied.

The quirks of each kind of file are handled here, once: llama.cpp's permuted Q/K rows in llama GGUF files, tensors
a family names or shapes otherwise, Hugging Face names, norms stored minus an offset, and Mamba2's A_log.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors import SafetensorError, safe_open

from kvlm.errors import ModelFileError
from kvlm.kernels import NATIVE_TYPES, BlockMatrix
from kvlm.loader.gguf_reader import GGUFFile, TensorInfo

Stored = BlockMatrix | torch.Tensor
FLOAT_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
               GGMLQuantizationType.BF16: torch.bfloat16}
COPY_CHUNK_BYTES = 64 << 20  # a large tensor is copied out of the map in pieces, each released once copied


@dataclass(frozen=True)
class Entry:
    """What the file says of a tensor, without reading it."""

    shape: tuple[int, ...]  # torch order, as the file stores it
    stored_as: str  # a GGUF type name ("Q4_K", "F16") or a torch dtype name ("bfloat16")
    nbytes: int


def as_rows(index: slice | torch.Tensor | None, n: int) -> torch.Tensor:
    if index is None:
        return torch.arange(n)
    return torch.arange(n)[index] if isinstance(index, slice) else index


class GGUFTensors:
    """The tensors of a GGUF file, under kvlm's names.

    `renamed`: kvlm's name -> the file's, for whole-model tensors a family names otherwise; `permuted`: tensor name
    endings whose rows llama.cpp permuted for its RoPE -> the number of heads they hold.
    """

    def __init__(self, gguf: GGUFFile, renamed: dict[str, str] | None = None,
                 permuted: dict[str, int] | None = None) -> None:
        self.gguf = gguf
        self.renamed = renamed or {}
        self.permuted = permuted or {}

    def close(self) -> None:
        self.gguf.close()

    def _info(self, name: str) -> TensorInfo | None:
        return self.gguf.tensors.get(self.renamed.get(name, name))

    def entry(self, name: str) -> Entry | None:
        info = self._info(name)
        return None if info is None else Entry(info.shape, info.qtype.name, info.nbytes)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> Stored:
        info = self._info(name)
        self.gguf.check_complete(info)
        heads = next((n for ending, n in self.permuted.items() if name.endswith(ending)), 0)
        row_index = _unpermuted_rows(info.shape[0], rows, heads) if heads else rows
        if len(info.shape) == 2 and info.qtype in NATIVE_TYPES:
            return self._blocks(info, row_index, cols)
        return self._dense(info, row_index, cols)

    def _row_views(self, info: TensorInfo):
        """The tensor's bytes as [rows, row_bytes], and the function that releases a range of its rows."""
        rows = info.shape[0] if len(info.shape) > 1 else 1
        data = self.gguf.data(info).reshape(rows, -1)
        row_bytes = data.shape[1]
        return data, lambda first, last: self.gguf.release(info.offset + first * row_bytes, (last - first) * row_bytes)

    def _blocks(self, info: TensorInfo, rows, cols: slice | None) -> BlockMatrix:
        data, release = self._row_views(info)
        selected = as_rows(rows, data.shape[0])
        matrix = BlockMatrix(_copy_rows(data, selected, release), info.qtype, info.shape[1])
        return matrix if cols is None else matrix.columns(cols.start, cols.stop)

    def _dense(self, info: TensorInfo, rows, cols: slice | None) -> torch.Tensor:
        data, release = self._row_views(info)
        if info.qtype in FLOAT_TYPES and len(info.shape) > 1:  # only the rows asked for are read
            raw = _copy_rows(data, as_rows(rows, data.shape[0]), release)
            values = raw.view(FLOAT_TYPES[info.qtype]).reshape(-1, *info.shape[1:])
        elif info.qtype in FLOAT_TYPES:  # a vector: small, read whole
            values = _copy_rows(data, as_rows(None, 1), release).view(FLOAT_TYPES[info.qtype]).reshape(info.shape)
            values = values if rows is None else values[rows]
        else:
            try:
                values = torch.from_numpy(gguf_dequantize(data, info.qtype).copy()).reshape(info.shape)
            except NotImplementedError as exc:
                raise ModelFileError(f"{self.gguf.path}: tensor {info.name} has type {info.qtype.name}, which "
                                     "gguf cannot dequantize") from exc
            release(0, data.shape[0])
            values = values if rows is None else values[rows]
        return values if cols is None else values[:, cols].contiguous()


def _copy_rows(data: np.ndarray, rows: torch.Tensor, release: Callable[[int, int], None]) -> torch.Tensor:
    """Rows of a mapped [rows, row_bytes] array, copied into memory of our own, in pieces of COPY_CHUNK_BYTES; the
    pages of each piece are released from the map once copied."""
    out = torch.empty(len(rows), data.shape[1], dtype=torch.uint8)
    contiguous = len(rows) > 0 and bool((rows[1:] - rows[:-1] == 1).all())
    step = max(1, COPY_CHUNK_BYTES // max(1, data.shape[1]))
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        if contiguous:
            first, last = int(part[0]), int(part[-1]) + 1
            out[start:start + len(part)].numpy()[:] = data[first:last]
            release(first, last)
        else:
            out[start:start + len(part)].numpy()[:] = data[part.numpy()]
    if not contiguous and len(rows):
        release(int(rows.min()), int(rows.max()) + 1)
    return out


def _unpermuted_rows(n_rows: int, rows: slice | None, n_head: int) -> torch.Tensor:
    """The file's row for each row in Hugging Face order (llama.cpp permutes each head's rows for its RoPE:
    Hugging Face pairs dims i and i + d/2, the file stores them side by side), then `rows` of those."""
    order = torch.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
    return order if rows is None else order[rows]


class SafetensorsTensors:
    """The tensors of a Hugging Face folder's *.safetensors files, read through safetensors' lazy slices.

    `names`: kvlm's name -> (file, the folder's name); `convert`: kvlm name -> a function applied to the read
    tensor (norm offsets, Mamba2's A), in float32.
    """

    def __init__(self, names: dict[str, tuple[Path, str]], convert: dict[str, Callable[[torch.Tensor], torch.Tensor]],
                 shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> None:
        self.names, self.convert, self.shapes, self.dtypes = names, convert, shapes, dtypes
        self._files: dict[Path, object] = {}

    def entry(self, name: str) -> Entry | None:
        if name not in self.names:
            return None
        shape = self.shapes[name]
        size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.dtypes[name], 4)
        return Entry(shape, self.dtypes[name], int(np.prod(shape)) * size)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        file, stored_name = self.names[name]
        shape = self.shapes[name]
        try:
            part = self._handle(file).get_slice(stored_name)
            if len(part.get_shape()) == len(shape):  # only the part asked for is read
                value = part[tuple(s if s is not None else slice(None) for s in (rows, cols)[:len(shape)])]
            else:  # a depthwise convolution [C, 1, W], GGUF's [C, W]: small, read whole
                value = part[:].reshape(shape)[rows if rows is not None else slice(None)]
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: not a readable safetensors file ({exc})") from exc
        return self.convert[name](value.float()) if name in self.convert else value

    def close(self) -> None:
        self._files.clear()

    def _handle(self, file: Path):
        if file not in self._files:
            self._files[file] = safe_open(file, "pt")
        return self._files[file]


def block_weights(stored_as: str) -> int:
    """How many weights share a block in a stored type (1 for float types)."""
    if stored_as in GGMLQuantizationType.__members__:
        return GGML_QUANT_SIZES[GGMLQuantizationType[stored_as]][0]
    return 1
