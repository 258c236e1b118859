"""Kernels of our own where torch has none fast enough, each beside the pure-torch reference it is tested against.

- `BlockMatrix`: a matrix as a GGUF file stores it (rows of quantized blocks).
- `native_kernels()`: the C++ kernels built for this CPU (products straight from the blocks, exact dequantization), or
  None where they cannot be built (see kvlm.kernels.native).
- `dequantize`: gguf's values of a block matrix, bit for bit, natively where possible.
"""
from __future__ import annotations

import torch

from kvlm.kernels import reference
from kvlm.kernels.blocks import NATIVE_TYPES, BlockMatrix
from kvlm.kernels.native import load as native_kernels

__all__ = ["NATIVE_TYPES", "BlockMatrix", "dequantize", "native_kernels"]


def dequantize(matrix: BlockMatrix, dtype: torch.dtype = torch.float32,
               ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (all when None) of the matrix as float32 or bfloat16, gguf's values bit for bit."""
    kernels = native_kernels()
    if kernels is not None:
        return kernels.dequantize(matrix, dtype, ids)
    return reference.dequantize(matrix if ids is None else matrix.rows(ids), dtype)
