"""Dense float weights times activations through the native library (csrc/dense.h): each output row the same bits
whatever other rows share the call and whatever the number of threads, which MKL's GEMM does not promise; the
weights rearranged once into panels of 8 rows, in their own dtype (bf16 and f16 stay 2 bytes a value).
tests/kernels/test_dense_kernel.py compares it with a float64 product."""
from __future__ import annotations

import ctypes

import torch

from kvlm.kernels.layer_ops import KV_TYPES

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_BAD_SHAPE = 2  # products.h Status


def output_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """What a native product of `x` writes: `out_dtype` (float32 or bfloat16), by default x's dtype."""
    if out_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"a native product writes float32 or bfloat16, not {out_dtype}")
    return out_dtype or x.dtype


class NativeDenseProduct:
    """x @ weight.T for a weight [out_features, in_features] of float32, float16 or bfloat16."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor) -> None:
        if weight.dtype not in KV_TYPES or weight.dim() != 2 or weight.numel() == 0:
            raise ValueError(f"expected a float32, float16 or bfloat16 [out, in] weight, got {weight.dtype} "
                             f"{list(weight.shape)}")
        self._call = lib.kvlm_dense_matmul
        self._call.argtypes = [_ptr, _i32, _i64, _i64, _ptr, _i32, _i64, _ptr, _i32, _i32]
        pack = lib.kvlm_dense_pack
        pack.argtypes = [_ptr, _i32, _i64, _i64, _ptr, _i32]
        self.out_features, self.in_features = weight.shape
        self._type = KV_TYPES[weight.dtype]
        weight = weight.contiguous()
        self.weight = torch.empty_like(weight)  # the panels (dense.h), kept alive for the pointer passed below
        status = pack(weight.data_ptr(), self._type, self.out_features, self.in_features, self.weight.data_ptr(),
                      torch.get_num_threads())
        if status:
            raise ValueError(f"the native dense product cannot pack a weight {list(weight.shape)} (status {status})")

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [m, in_features] float32 or bfloat16 -> [m, out_features] in `out_dtype` (float32 or bfloat16; None: x's
        dtype): float32 from bfloat16 activations is the sums as they are, before any rounding."""
        if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected float32 or bfloat16 x [m, {self.in_features}] for a weight "
                             f"[{self.out_features}, {self.in_features}], got {x.dtype} {list(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=output_dtype(x, out_dtype))
        bf16, out_bf16 = int(x.dtype == torch.bfloat16), int(y.dtype == torch.bfloat16)
        status = self._call(x.data_ptr(), bf16, x.shape[0], self.in_features, self.weight.data_ptr(), self._type,
                            self.out_features, y.data_ptr(), out_bf16, torch.get_num_threads())
        if status:
            raise ValueError(f"the native dense product cannot take x {list(x.shape)} times a weight "
                             f"[{self.out_features}, {self.in_features}] (status {status})")
        return y
