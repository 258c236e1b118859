"""Matrix-vector products with dense or weight-only quantized weights.

Decode at small batch is bound by reading weights from memory, so storing them in 8 or 4 bits makes it
faster. The int kernels take bfloat16 activations. Group-wise int4 with a min/max per 32 weights
reproduces GGUF Q4_1 blocks exactly (their levels are min + q * (max - min) / 15).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTS = ("int8", "int4")
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_single_row and x.shape[0] == 1:
            return self._product(x.expand(2, -1))[:1]
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


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


Linear = DenseLinear | PackedLinear | Int8Linear | Int4Linear


def make_linear(weight: torch.Tensor, dtype: torch.dtype, quant: str | None, batch_invariant: bool = False) -> Linear:
    """float32 stays on MKL (what transformers uses, so logits match it) unless `batch_invariant` asks for
    a product whose rows do not depend on the batch."""
    if quant == "int8":
        return Int8Linear(weight)
    if quant == "int4":
        return Int4Linear(weight)
    if torch.backends.mkldnn.is_available() and (dtype == torch.bfloat16 or batch_invariant):
        return PackedLinear(weight, dtype)
    return DenseLinear(weight, dtype)
