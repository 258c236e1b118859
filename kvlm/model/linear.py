"""Matrix-vector products with dense or weight-only quantized weights.

Decode at small batch is bound by reading weights from memory, so storing them in 8 or 4 bits makes it
faster. The int kernels take bfloat16 activations. Group-wise int4 with a min/max per 32 weights
reproduces GGUF Q4_1 blocks exactly (their extremes are levels by construction); Q4_0 and Q4_K blocks, whose
levels are also min + q * step but whose extremes need not occur, come back within half of the file's step.
Many rows at once (prefill, large batches) are bound by arithmetic instead, where oneDNN's bf16 GEMM is 2-3x
faster than the int kernels: a quantized matrix keeps a packed bf16 copy for those when memory allows.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kvlm.model.cpu import onednn_packs

INT4_GROUP = 32


class DenseLinear:
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


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
        self._register()

    def _register(self) -> None:
        self.out_features = self.weight.shape[0]
        _PACKED[id(self)] = self

    def __getstate__(self) -> dict:
        """Saved in the plain layout (oneDNN's blocked tensors cannot be serialised) and repacked on load."""
        return {"weight": self.weight.to_dense(), "pad_single_row": self.pad_single_row}

    def __setstate__(self, state: dict) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(state["weight"], self.PACK_FOR_BATCH)
        self.pad_single_row = state["pad_single_row"]
        self._register()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _packed_product(x, id(self))
        if self.pad_single_row and x.shape[0] == 1:
            return self._product(x.expand(2, -1))[:1]
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


# Packed products by handle, for graphs: inductor cannot lower oneDNN's blocked weights, so a compiled graph
# calls the product as one opaque op that finds its weights here.
_PACKED: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()


@torch.library.custom_op("kvlm::packed_product", mutates_args=())
def _packed_product(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _PACKED[handle]._product(x)


@_packed_product.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _PACKED[handle].out_features)


class Int8Linear:
    """Symmetric int8 per output row."""

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.float()
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.weight = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight, self.scale)


class Int4Linear:
    """Asymmetric int4 in groups of 32 along the input dimension, packed for torch's CPU kernel."""

    def __init__(self, weight: torch.Tensor) -> None:
        rows, cols = weight.shape
        if cols % INT4_GROUP:
            raise ValueError(f"int4 weights need an input size divisible by {INT4_GROUP}, got {cols}")
        groups = weight.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low) / 15
        levels = torch.round((groups - low[..., None]) / scale.clamp_min(1e-12)[..., None]).clamp_(0, 15)
        self.weight = torch._convert_weight_to_int4pack_for_cpu(levels.view(rows, cols).to(torch.int32), 1)
        # The kernel computes (q - 8) * scale + zero; our levels are low + q * scale.
        zero = low + 8 * scale
        self.scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scales_and_zeros)


class RowAdaptiveLinear:
    """A weight-only quantized matrix for a few rows (memory-bound), its packed bf16 copy for more."""

    MAX_QUANTIZED_ROWS = 4  # bench: [B,576]x[576,3072] int4 beats packed bf16 at B=1, loses by B=8

    def __init__(self, quantized: Int8Linear | Int4Linear, dense: PackedLinear) -> None:
        self.quantized, self.dense = quantized, dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x) if x.shape[0] <= self.MAX_QUANTIZED_ROWS else self.dense(x)


Linear = DenseLinear | PackedLinear | Int8Linear | Int4Linear | RowAdaptiveLinear
QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear}


def _dequantized(linear: Int8Linear | Int4Linear, in_features: int) -> torch.Tensor:
    """The weights the kernel multiplies by, as bf16 [out, in]: its product with the identity."""
    return linear(torch.eye(in_features, dtype=torch.bfloat16)).t()


def linear_kind(linear: Linear) -> str:
    """How a matrix is stored and multiplied, in words."""
    if isinstance(linear, RowAdaptiveLinear):
        return f"{linear_kind(linear.quantized)} (bf16 above {linear.MAX_QUANTIZED_ROWS} rows)"
    names = {DenseLinear: "dense", PackedLinear: "dense packed", Int8Linear: "int8", Int4Linear: "int4"}
    return names[type(linear)]


def make_linear(weight: torch.Tensor, dtype: torch.dtype, quant: str | None, batch_invariant: bool = False,
                dense_copy: bool = False) -> Linear:
    """float32 stays on MKL (what transformers uses, so logits match it) unless `batch_invariant` asks for
    a product whose rows do not depend on the batch. `dense_copy` adds bf16 for many rows to a quantized one."""
    packs = onednn_packs(dtype)
    if quant is not None:
        quantized = QUANTIZED[quant](weight)
        if not (dense_copy and packs):
            return quantized
        return RowAdaptiveLinear(quantized, PackedLinear(_dequantized(quantized, weight.shape[1]), dtype))
    if packs and (dtype == torch.bfloat16 or batch_invariant):
        return PackedLinear(weight, dtype)
    return DenseLinear(weight, dtype)
