"""Matrix products: dense float weights, or a GGUF file's quantized blocks as the file stores them.

Decode at small batch is bound by reading weights from memory, so a quantized matrix is kept in its file's blocks
and multiplied by kvlm's native kernels straight from them (activations quantized to 8 bits as llama.cpp does;
see kvlm.kernels), at every row count: each output row comes out the same whatever rows share the product.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kvlm.kernels import BlockMatrix
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


class _NativeLinear:
    """A product through kvlm's native kernels (`native`): at every row count, each output row the same bits
    whatever rows share it, so a token's logits do not depend on its batch; one opaque op inside a compiled graph."""

    def __init__(self, native) -> None:
        self.native = native
        self.out_features = native.out_features
        _OPAQUE[id(self)] = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _opaque_product(x, id(self))
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self.native(x)


class QuantizedLinear(_NativeLinear):
    """Blocks of one or more stacked parts (Q, K and V may be stored in different formats), multiplied by the native
    kernels at every row count. (A dense bf16 copy would beat them above 8 rows on CPUs with native bf16, but would
    round those rows otherwise.)"""

    def __init__(self, parts: list[BlockMatrix], dtype: torch.dtype, kernels: NativeKernels) -> None:
        self.parts, self.dtype = parts, dtype
        super().__init__(kernels.product(parts))

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


class NativeDenseLinear(_NativeLinear):
    """Dense float32, float16 or bfloat16 weights (the latter two kept at 2 bytes a value, as a file stores them)
    through the native dense product (kvlm/kernels/csrc/dense.h)."""

    def __init__(self, weight: torch.Tensor, kernels: NativeKernels) -> None:
        super().__init__(kernels.dense(weight))

    @property
    def nbytes(self) -> int:
        return self.native.nbytes


Linear = DenseLinear | PackedLinear | QuantizedLinear | NativeDenseLinear


def float32_product(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T in float32 (the logits): the native products write their float32 sums as they are, without rounding
    them to bfloat16 activations' dtype and converting back (a copy of a whole batch's logits); the others convert."""
    if isinstance(linear, _NativeLinear) and not torch.compiler.is_compiling():
        return linear.native(x, torch.float32)
    return linear(x).float()


# Products by handle, for graphs: inductor can neither lower oneDNN's blocked weights nor call ctypes, so a
# compiled graph calls the product as one opaque op that finds its weights here.
_OPAQUE: weakref.WeakValueDictionary[int, PackedLinear | _NativeLinear] = weakref.WeakValueDictionary()


@torch.library.custom_op("kvlm::opaque_product", mutates_args=())
def _opaque_product(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _OPAQUE[handle].product(x)


@_opaque_product.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _OPAQUE[handle].out_features)


def linear_kind(linear: Linear) -> str:
    """How a matrix is stored and multiplied, in words."""
    if isinstance(linear, QuantizedLinear):
        return "+".join(dict.fromkeys(part.qtype.name for part in linear.parts))
    return {DenseLinear: "dense", PackedLinear: "dense packed", NativeDenseLinear: "dense native"}[type(linear)]


def dense_linear(weight: torch.Tensor, dtype: torch.dtype, batch_invariant: bool = False,
                 kernels: NativeKernels | None = None) -> Linear:
    """A product for dense weights with `dtype` activations. Batch-invariant: the native dense product where the
    kernels are built (`kernels`; float16 and bfloat16 weights kept as they are, any other in `dtype`), else
    oneDNN's packed one, whose rows do not depend on the number of rows either. Otherwise float32 stays on MKL
    (what transformers uses, so logits match it) and bfloat16 is packed for oneDNN where it can be."""
    if batch_invariant and kernels is not None:
        kept = weight if weight.dtype in (torch.float16, torch.bfloat16) else weight.to(dtype)
        return NativeDenseLinear(kept, kernels)
    if onednn_packs(dtype) and (dtype == torch.bfloat16 or batch_invariant):
        return PackedLinear(weight, dtype)
    return DenseLinear(weight, dtype)
