"""A model file's tensors, read one at a time: what the file stores, under GGUF names, in torch's layout.

`read(name, rows, cols)` returns a 2-D tensor of a block format kvlm's kernels read as a `BlockMatrix` (the
file's bytes, read into memory of its own), and anything else as a dense tensor in the file's own float dtype
(float32 for other quantized formats, dequantized by gguf). `rows` and `cols` select a part (a tensor-parallel
shard), so only that part is ever read.

The quirks of each kind of file are handled here, once: llama.cpp's permuted Q/K rows in llama GGUF files, tensors
a family names or shapes otherwise, Hugging Face names, norms stored minus an offset, and Mamba2's A_log.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors import SafetensorError, safe_open

from kvlm.core.errors import ModelFileError
from kvlm.kernels import NATIVE_TYPES, BlockMatrix
from kvlm.loader.gguf_reader import GGUFFile, TensorInfo
from kvlm.loader.gguf_split import SplitGGUF

Stored = BlockMatrix | torch.Tensor
Layout = Callable[[BlockMatrix], BlockMatrix]  # a block matrix rearranged in place for the kernels that read it
OWN, MAPPED = "own", "mapped"  # how a block matrix's bytes are kept: read into fresh memory, or the file's mapped
FLOAT_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
               GGMLQuantizationType.BF16: torch.bfloat16}


@dataclass(frozen=True)
class Entry:
    """What the file says of a tensor, without reading it."""

    shape: tuple[int, ...]  # torch order, as the file stores it
    stored_as: str  # a GGUF type name ("Q4_K", "F16") or a torch dtype name ("bfloat16")
    nbytes: int


@dataclass(frozen=True)
class ExpertParts:
    """A tensor of experts [expert, rows, cols] that a file stores otherwise: one tensor per expert (older Mixtral
    files: blk.N.ffn_gate.E.weight), or one half of each expert's rows of a fused gate/up tensor
    (blk.N.ffn_gate_up_exps.weight: each expert's gate rows, then its up rows)."""

    tensors: tuple[TensorInfo, ...]
    half: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.tensors[0]
        if self.half is None:
            return (len(self.tensors), *first.shape)
        return (first.shape[0], first.shape[1] // 2, first.shape[2])

    @property
    def entry(self) -> Entry:
        nbytes = sum(t.nbytes for t in self.tensors)
        return Entry(self.shape, self.tensors[0].qtype.name, nbytes // 2 if self.half is not None else nbytes)


class GGUFTensors:
    """The tensors of a GGUF file, under kvlm's names.

    `renamed`: kvlm's name -> the file's, for whole-model tensors a family names otherwise; `permuted`: tensor name
    endings whose rows llama.cpp permuted for its RoPE -> the number of heads they hold; `experts`: tensors of
    experts the file stores otherwise than as one tensor.
    """

    def __init__(self, gguf: GGUFFile | SplitGGUF, renamed: dict[str, str] | None = None,
                 permuted: dict[str, int] | None = None, experts: dict[str, ExpertParts] | None = None) -> None:
        self.gguf = gguf
        self.renamed = renamed or {}
        self.permuted = permuted or {}
        self.experts = experts or {}

    def close(self) -> None:
        self.gguf.close()

    @property
    def files(self) -> list[Path]:
        return self.gguf.paths

    def _info(self, name: str) -> TensorInfo | None:
        return self.gguf.tensors.get(self.renamed.get(name, name))

    def entry(self, name: str) -> Entry | None:
        if name in self.experts:
            return self.experts[name].entry
        info = self._info(name)
        return None if info is None else Entry(info.shape, info.qtype.name, info.nbytes)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None,
             layout: Layout | None = None) -> Stored:
        """`layout`: what rearranges a block matrix in place for the kernels (its bytes then read into memory of
        their own); without, a block matrix is kept as the file stores it, as a private map of the file's bytes
        where it can be (nothing copied: the pages are the page cache's)."""
        if name in self.experts:
            return _laid_out(self._expert_parts(self.experts[name], rows, cols), layout)
        info = self._info(name)
        self.gguf.check_complete(info)
        heads = next((n for ending, n in self.permuted.items() if name.endswith(ending)), 0)
        row_index = _unpermuted_rows(info.shape[0], rows, heads) if heads else rows
        if len(info.shape) == 3:
            return _laid_out(self._experts(info, rows, cols), layout)
        if len(info.shape) == 2 and info.qtype in NATIVE_TYPES:
            keep = None if cols is not None else OWN if layout is not None else MAPPED
            return _laid_out(self._blocks(info, row_index, cols, keep), layout)
        return self._dense(info, row_index, cols)

    def _experts(self, info: TensorInfo, rows: slice | None, cols: slice | None) -> Stored:
        """A tensor of experts [expert, rows, cols], `rows` and `cols` of each expert's matrix: of a block format
        the kernels read, a BlockMatrix of every expert's rows in turn (the file's own layout); else dense."""
        n_expert, n_rows, _ = info.shape
        if info.qtype not in NATIVE_TYPES:
            values = self._dense(info, None, None).reshape(info.shape)
            return values[:, rows if rows is not None else slice(None), cols if cols is not None else slice(None)]
        row_bytes = info.nbytes // (n_expert * n_rows)
        first, last, _ = (rows or slice(None)).indices(n_rows)
        starts = [info.offset + (expert * n_rows + first) * row_bytes for expert in range(n_expert)]
        return self._expert_blocks(info, starts, last - first, row_bytes, cols)

    def _expert_blocks(self, info: TensorInfo, starts: list[int], n_rows: int, row_bytes: int,
                       cols: slice | None) -> BlockMatrix:
        """n_rows rows of each expert, from the file offsets `starts`, stacked as one BlockMatrix (its columns
        `cols`): one read where the experts' rows follow one another in the file."""
        out = kept_memory(len(starts) * n_rows * row_bytes).view(len(starts), n_rows, row_bytes)
        if starts == [starts[0] + expert * n_rows * row_bytes for expert in range(len(starts))]:
            self.gguf.read_into(out, starts[0])
        else:  # each expert's share of rows (a tensor-parallel rank's, a half of a fused tensor), or its own tensor
            for expert, start in enumerate(starts):
                self.gguf.read_into(out[expert], start)
        matrix = BlockMatrix(out.view(-1, row_bytes), info.qtype, info.shape[-1])
        return matrix if cols is None else matrix.columns(cols.start, cols.stop)

    def _expert_parts(self, parts: ExpertParts, rows: slice | None, cols: slice | None) -> Stored:
        """The experts of `parts` as one tensor of experts would read (see _experts)."""
        n_rows = parts.shape[1]
        first, last, _ = (rows or slice(None)).indices(n_rows)
        if parts.half is not None:  # the half's rows of each expert's stacked gate and up
            offset = parts.half * n_rows
            return self._experts(parts.tensors[0], slice(offset + first, offset + last), cols)
        info = parts.tensors[0]
        if info.qtype not in NATIVE_TYPES:
            values = torch.stack([self._dense(t, None, None) for t in parts.tensors])
            return values[:, first:last, cols if cols is not None else slice(None)]
        for tensor in parts.tensors:
            self.gguf.check_complete(tensor)
        row_bytes = info.nbytes // n_rows
        return self._expert_blocks(info, [t.offset + first * row_bytes for t in parts.tensors], last - first,
                                   row_bytes, cols)

    def _rows(self, info: TensorInfo, rows, keep: str | None = None) -> torch.Tensor:
        """Rows of the tensor's bytes as uint8 [n, row_bytes] (a vector is one row). `keep`: None for bytes
        converted and let go (read with pread into memory of their own, so the file's pages never enter this
        process); OWN for bytes the model keeps and rearranges (read into fresh memory populated in one call);
        MAPPED for bytes it keeps as they are (a private map of the file's rows). A gather (Q/K rows in Hugging
        Face order) reads the rows it spans, then picks."""
        n_rows = info.shape[0] if len(info.shape) > 1 else 1
        row_bytes = info.nbytes // n_rows
        memory = kept_memory if keep is not None else lambda n: torch.empty(n, dtype=torch.uint8)
        if rows is None or isinstance(rows, slice):
            first, last, _ = (rows or slice(None)).indices(n_rows)
            if keep == MAPPED:
                return self.gguf.mapped(info.offset + first * row_bytes, (last - first) * row_bytes).view(
                    last - first, row_bytes)
            out = memory((last - first) * row_bytes).view(last - first, row_bytes)
            self.gguf.read_into(out, info.offset + first * row_bytes)
            return out
        first, last = int(rows.min()), int(rows.max()) + 1
        span = torch.empty(last - first, row_bytes, dtype=torch.uint8)
        self.gguf.read_into(span, info.offset + first * row_bytes)
        out = memory(len(rows) * row_bytes).view(len(rows), row_bytes)
        return torch.index_select(span, 0, rows - first, out=out)

    def _blocks(self, info: TensorInfo, rows, cols: slice | None, keep: str | None) -> BlockMatrix:
        matrix = BlockMatrix(self._rows(info, rows, keep), info.qtype, info.shape[1])
        return matrix if cols is None else matrix.columns(cols.start, cols.stop)

    def _dense(self, info: TensorInfo, rows, cols: slice | None) -> torch.Tensor:
        vector = len(info.shape) == 1
        if info.qtype in FLOAT_TYPES:  # a matrix's rows asked for; a vector whole (it is small)
            raw = self._rows(info, None if vector else rows)
            values = raw.view(FLOAT_TYPES[info.qtype]).reshape(-1, *info.shape[1:])
            values = values.reshape(info.shape)[rows if rows is not None else slice(None)] if vector else values
        else:
            try:
                whole = gguf_dequantize(self._rows(info, None).numpy(), info.qtype)
            except NotImplementedError as exc:
                raise ModelFileError(f"{self.gguf.path}: tensor {info.name} has type {info.qtype.name}, which "
                                     "gguf cannot dequantize") from exc
            values = torch.from_numpy(whole).reshape(info.shape)
            values = values if rows is None else values[rows]
        return values if cols is None else values[:, cols].contiguous()


def _laid_out(value: Stored, layout: Layout | None) -> Stored:
    return layout(value) if layout is not None and isinstance(value, BlockMatrix) else value


def kept_memory(nbytes: int) -> torch.Tensor:
    """Memory for bytes the model keeps, mapped in one call (MAP_POPULATE): a page fault per 4 KB, as memory
    first touched while reading takes, cost more than reading the file (measured: 1.9 vs 2.6 GB/s loading a 1 GB
    file from the page cache)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=flags), dtype=torch.uint8)[:nbytes]


def _unpermuted_rows(n_rows: int, rows: slice | None, n_head: int) -> torch.Tensor:
    """The file's row for each row in Hugging Face order (llama.cpp permutes each head's rows for its RoPE:
    Hugging Face pairs dims i and i + d/2, the file stores them side by side), then `rows` of those."""
    order = torch.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
    return order if rows is None else order[rows]


@dataclass(frozen=True)
class HFSource:
    """Where a tensor is in a Hugging Face folder: one stored tensor, or one per expert (stacked on read); `half` 0 or
    1 takes the first or second half of its rows (a gate and an up projection stored as one tensor). `interleaved`:
    gpt-oss's experts, stored [expert, in, out] (read whole and transposed), whose halves are the even and the odd
    rows (of a bias [expert, out], the even and odd values)."""

    parts: tuple[tuple[Path, str], ...]
    half: int | None = None
    interleaved: bool = False
    scales: tuple[Path, str] | None = None  # MXFP4 (gpt-oss's folders): parts[0] holds the blocks, this their scales


class SafetensorsTensors:
    """The tensors of a Hugging Face folder's *.safetensors files, read through safetensors' lazy slices.

    `names`: kvlm's name -> where it is stored; `convert`: kvlm name -> a function applied to the read tensor (norm
    offsets, Mamba2's A), in float32. `rows` and `cols` of a read select the rows and columns of each expert's
    matrix in a tensor of experts [expert, rows, cols].
    """

    def __init__(self, names: dict[str, HFSource], convert: dict[str, Callable[[torch.Tensor], torch.Tensor]],
                 shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> None:
        self.names, self.convert, self.shapes, self.dtypes = names, convert, shapes, dtypes
        self._files: dict[Path, object] = {}

    def entry(self, name: str) -> Entry | None:
        if name not in self.names:
            return None
        shape, stored_as = self.shapes[name], self.dtypes[name]
        if stored_as in GGMLQuantizationType.__members__:  # MXFP4 blocks
            weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[stored_as]]
            return Entry(shape, stored_as, int(np.prod(shape)) // weights * nbytes)
        size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(stored_as, 4)
        return Entry(shape, stored_as, int(np.prod(shape)) * size)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None,
             layout: Layout | None = None) -> Stored:
        """`layout` as GGUFTensors.read's (for MXFP4 blocks, made in memory of their own)."""
        source, shape = self.names[name], self.shapes[name]
        if source.scales is not None:
            return _laid_out(self._mxfp4(source, rows, cols), layout)
        per_part = shape[1:] if len(source.parts) > 1 else shape
        try:
            values = [self._read(file, stored, per_part, source, rows, cols) for file, stored in source.parts]
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{source.parts[0][0]}: not a readable safetensors file ({exc})") from exc
        value = torch.stack(values) if len(values) > 1 else values[0]
        return self.convert[name](value.float()) if name in self.convert else value

    def _read(self, file: Path, stored: str, shape: tuple[int, ...], source: HFSource, rows, cols) -> torch.Tensor:
        """One stored tensor's part of `shape` (its matrix's rows and columns as asked): only that part is read."""
        part, half = self._handle(file).get_slice(stored), source.half
        if source.interleaved:
            return _interleaved_part(part[:], half, rows, cols)
        if len(part.get_shape()) != len(shape):  # a depthwise convolution [C, 1, W], GGUF's [C, W]: small, read whole
            return part[:].reshape(shape)[rows if rows is not None else slice(None)]
        if half is not None:  # rows of one half of the stored rows
            n = shape[-2]
            first, last, _ = (rows or slice(None)).indices(n)
            rows = slice(half * n + first, half * n + last)
        if len(shape) == 1:
            return part[rows if rows is not None else slice(None)]
        leading = (slice(None),) * (len(shape) - 2)
        return part[(*leading, rows if rows is not None else slice(None), cols if cols is not None else slice(None))]

    def _mxfp4(self, source: HFSource, rows: slice | None, cols: slice | None) -> BlockMatrix:
        """gpt-oss's MXFP4 experts ([expert, out, in / 32] blocks of 16 bytes and their scales, gate and up rows
        interleaved) as GGUF's MXFP4 blocks: the same values, every expert's rows in turn."""
        (file, blocks_name), (scales_file, scales_name) = source.parts[0], source.scales
        try:
            blocks = self._handle(file).get_slice(blocks_name)[:]
            scales = self._handle(scales_file).get_slice(scales_name)[:]
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{file}: not a readable safetensors file ({exc})") from exc
        if source.half is not None:
            blocks, scales = blocks[:, source.half::2], scales[:, source.half::2]
        if rows is not None:
            blocks, scales = blocks[:, rows], scales[:, rows]
        packed = gguf_mxfp4_blocks(blocks, scales)
        matrix = BlockMatrix(packed.reshape(-1, packed.shape[-2] * packed.shape[-1]), GGMLQuantizationType.MXFP4,
                             packed.shape[-2] * 32)
        return matrix if cols is None else matrix.columns(cols.start, cols.stop)

    def close(self) -> None:
        self._files.clear()

    @property
    def files(self) -> list[Path]:
        """The files its tensors are read from."""
        return sorted({file for source in self.names.values()
                       for file, _ in (*source.parts, *([source.scales] if source.scales else []))})

    def _handle(self, file: Path):
        if file not in self._files:
            self._files[file] = safe_open(file, "pt")
        return self._files[file]


def gguf_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 ([..., G, 16] bytes, each byte's low nibble an even weight, its high nibble the next; [..., G]
    E8M0 scales) as GGUF's MXFP4 blocks [..., G, 17]: the scale byte (the same E8M0), then weights 0-15 in the low
    nibbles and 16-31 in the high ones. The same values: only the nibbles move."""
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], 32)  # weight order
    out = kept_memory(scales.numel() * 17).view(*scales.shape, 17)
    out[..., 0] = scales
    torch.bitwise_or(codes[..., :16], codes[..., 16:] << 4, out=out[..., 1:])
    return out


def _interleaved_part(value: torch.Tensor, half: int | None, rows, cols) -> torch.Tensor:
    """gpt-oss's experts [expert, in, out] as [expert, out, in] (biases [expert, out]), the even (`half` 0) or odd
    (1) rows of it, then `rows` and `cols` of those (of a bias, `cols` of its values, as of a GGUF file's 2-D
    bias)."""
    every = slice(None)
    if value.dim() == 3:
        value = value.transpose(1, 2)
        value = value if half is None else value[:, half::2]
        return value[:, rows if rows is not None else every, cols if cols is not None else every].contiguous()
    value = value if half is None else value[:, half::2]
    return value[:, cols if cols is not None else every].contiguous()


def block_weights(stored_as: str) -> int:
    """How many weights share a block in a stored type (1 for float types)."""
    if stored_as in GGMLQuantizationType.__members__:
        return GGML_QUANT_SIZES[GGMLQuantizationType[stored_as]][0]
    return 1
