"""Matrix products: dense float weights, or a GGUF file's quantized blocks as the file stores them.

Decode at small batch is bound by reading weights from memory, so a quantized matrix is kept in its file's blocks
and multiplied by kvlm's native kernels straight from them (activations quantized to 8 bits as llama.cpp does;
see kvlm.kernels). Many rows at once (prefill, large batches) are bound by arithmetic instead, where oneDNN's bf16
GEMM is faster: there a quantized matrix uses its packed bf16 copy when the memory plan made one, and otherwise
dequantizes itself for that one product (a transient the size of the matrix, gone after it).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from kvlm.kernels import BlockMatrix, dequantize
from kvlm.kernels.blocks import TILE_ROWS
from kvlm.kernels.native import NativeKernels
from kvlm.model.cpu import onednn_packs


class DenseLinear:
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class PackedLinear:
    """float32 or bfloat16 weights reordered once into oneDNN's blocked layout.

    Plain F.linear repacks a bf16 weight on every call, which costs more than the product itself when
    weights stream from memory. In float32 (the batch-invariant mode), each output row comes out of oneDNN
    the same whatever the number of rows, which MKL does not guarantee below 4-16 rows; only a single row
    takes another kernel, so it is computed as two (about +5% on that product).
    """

    PACK_FOR_BATCH = 32  # a layout hint only: any batch size works

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), self.PACK_FOR_BATCH)
        self.pad_single_row = dtype == torch.float32
        self.out_features = self.weight.shape[0]
        self.nbytes = weight.numel() * torch.empty(0, dtype=dtype).element_size()
        _OPAQUE[id(self)] = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _opaque_product(x, id(self))
        if self.pad_single_row and x.shape[0] == 1:
            return self.product(x.expand(2, -1))[:1]
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


TRANSIENT_BYTES = 64 << 20  # the most a product of many rows without a dense copy dequantizes at once


class QuantizedLinear:
    """Blocks of one or more stacked parts (Q, K and V may be stored in different formats), multiplied natively
    up to MAX_QUANTIZED_ROWS rows; above, through `dense` (a packed bf16 copy), or without one natively up to
    MAX_ROWS_WITHOUT_COPY and through dequantized slices above.

    bench/quantized_products.py on a 7B's matrices (which stream from memory, as every matrix does in a real step):
    native beats the packed copy through 4-8 rows, and dequantizing slices through about 48."""

    MAX_QUANTIZED_ROWS = 8
    MAX_ROWS_WITHOUT_COPY = 48

    def __init__(self, parts: list[BlockMatrix], dtype: torch.dtype, kernels: NativeKernels,
                 dense: PackedLinear | None = None) -> None:
        self.parts, self.dtype, self.dense, self.kernels = parts, dtype, dense, kernels
        self.native = kernels.product(parts)
        self.out_features = self.native.out_features
        self.slices_pay = dense_products_pay(dtype, kernels)  # without a copy: else native at every row count
        _OPAQUE[id(self)] = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _opaque_product(x, id(self))
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_for(x.shape[0]):
            return self.native(x)
        return self.dense(x) if self.dense is not None else self._through_slices(x)

    def native_for(self, rows: int) -> bool:
        """Whether a product of this many rows is the native kernels' (else the dense copy's, or dequantized
        slices')."""
        if self.dense is not None:
            return rows <= self.MAX_QUANTIZED_ROWS
        return not self.slices_pay or rows <= self.MAX_ROWS_WITHOUT_COPY

    def _through_slices(self, x: torch.Tensor) -> torch.Tensor:
        """x times the weights dequantized a slice of rows at a time, into one reused buffer of TRANSIENT_BYTES."""
        out = x.new_empty(x.shape[0], self.out_features)
        scratch = _scratch(self.dtype)
        column = 0
        for part in self.parts:
            step = max(TILE_ROWS, scratch.numel() // part.n_cols // TILE_ROWS * TILE_ROWS)  # whole tiles
            for first in range(0, part.shape[0], step):
                rows = part.rows(slice(first, first + step))
                weights = scratch[:rows.shape[0] * part.n_cols].view(rows.shape[0], part.n_cols)
                self.kernels.dequantize(rows, self.dtype, out=weights)
                out[:, column:column + rows.shape[0]] = F.linear(x, weights)
                column += rows.shape[0]
        return out

    def dequantized(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights as [out, in] in the activation dtype (gguf's values, rounded to it), into `out` if given."""
        if out is None:
            out = torch.empty(self.out_features, self.parts[0].n_cols, dtype=self.dtype)
        first = 0
        for part in self.parts:
            self.kernels.dequantize(part, self.dtype, out=out[first:first + part.shape[0]])
            first += part.shape[0]
        return out

    @property
    def nbytes(self) -> int:
        """Memory held: the blocks, and the dense copy if there is one."""
        return sum(part.nbytes for part in self.parts) + (self.dense.nbytes if self.dense is not None else 0)


Linear = DenseLinear | PackedLinear | QuantizedLinear


@functools.cache
def _scratch(dtype: torch.dtype) -> torch.Tensor:
    """The buffer products of many rows (and dense copies being made) dequantize into: one per dtype, used by one
    product at a time (a model loads, and the engine runs its steps, on one thread)."""
    return torch.empty(TRANSIENT_BYTES // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)


# Products by handle, for graphs: inductor can neither lower oneDNN's blocked weights nor call ctypes, so a
# compiled graph calls the product as one opaque op that finds its weights here.
_OPAQUE: weakref.WeakValueDictionary[int, PackedLinear | QuantizedLinear] = weakref.WeakValueDictionary()


@torch.library.custom_op("kvlm::opaque_product", mutates_args=())
def _opaque_product(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _OPAQUE[handle].product(x)


@_opaque_product.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _OPAQUE[handle].out_features)


def linear_kind(linear: Linear) -> str:
    """How a matrix is stored and multiplied, in words."""
    if isinstance(linear, QuantizedLinear):
        formats = "+".join(dict.fromkeys(part.qtype.name for part in linear.parts))
        return formats + (f" (bf16 copy above {linear.MAX_QUANTIZED_ROWS} rows)" if linear.dense is not None else "")
    return {DenseLinear: "dense", PackedLinear: "dense packed"}[type(linear)]


def dense_linear(weight: torch.Tensor, dtype: torch.dtype, batch_invariant: bool = False) -> DenseLinear | PackedLinear:
    """float32 stays on MKL (what transformers uses, so logits match it) unless `batch_invariant` asks for a product
    whose rows do not depend on the batch; bfloat16 is packed for oneDNN where it can be."""
    if onednn_packs(dtype) and (dtype == torch.bfloat16 or batch_invariant):
        return PackedLinear(weight, dtype)
    return DenseLinear(weight, dtype)


def dense_products_pay(dtype: torch.dtype, kernels: NativeKernels | None) -> bool:
    """Whether dense products beat the native kernels on many rows, so that a quantized matrix is worth a dense
    copy (or dequantized slices) for prefill and large batches: oneDNN's bf16 GEMM on native bf16 instructions does;
    a float32 GEMM does not beat the tile kernels (bench/quantized_products.py: equal at 512 rows, slower below,
    with four times the bytes to read), only the plain C++ kernels of a build without AVX2."""
    if not onednn_packs(dtype):
        return False
    return dtype == torch.bfloat16 or kernels is None or not kernels.tiles


def quantized_linear(parts: list[BlockMatrix], dtype: torch.dtype, kernels: NativeKernels,
                     dense_copy: bool) -> QuantizedLinear:
    """`dense_copy`: keep a packed copy in the activation dtype too, for products of many rows, where such products
    pay (dense_products_pay)."""
    linear = QuantizedLinear(parts, dtype, kernels)
    if dense_copy and dense_products_pay(dtype, kernels):
        scratch = _scratch(dtype)  # the dense values only live until packed: no fresh memory to fault in
        size = linear.out_features * parts[0].n_cols
        weights = scratch[:size].view(linear.out_features, -1) if size <= scratch.numel() else None
        linear.dense = PackedLinear(linear.dequantized(weights), dtype)
    return linear
