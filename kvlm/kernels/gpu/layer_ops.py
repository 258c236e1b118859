"""RMSNorm (with the residual add) and RoPE in Triton: one program per row. Each computes in float32 and rounds once
at the end, as kvlm's native CPU ops do."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [rows, n] (contiguous); without `residual` the second is
    x itself. The sum is rounded to x's dtype before it is normed (it is the residual stream)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    if rows:
        _rms_norm[(rows,)](x, residual if residual is not None else x, weight, out, total, n, eps,
                           RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, total


@triton.jit
def _rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, total_ptr, n, eps, RESIDUAL: tl.constexpr,
              BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + row * n + i, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        x += tl.load(residual_ptr + row * n + i, mask=ok, other=0.0).to(tl.float32)
        x = x.to(total_ptr.dtype.element_ty)
        tl.store(total_ptr + row * n + i, x, mask=ok)
        x = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    weight = tl.load(weight_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + i, (x * inverse * weight).to(out_ptr.dtype.element_ty), mask=ok)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk [T, heads, d] (its last two dimensions contiguous) rotated in place by float32 cos, sin [T, 1, r]: the
    pairs (i, i + r/2) of each head's first r dims (r < d: partial RoPE), the rest untouched. Returns qk."""
    n_tokens, n_heads, dim = qk.shape
    rotated = cos.shape[-1]
    if n_tokens:
        cos, sin = cos.reshape(n_tokens, rotated).contiguous(), sin.reshape(n_tokens, rotated).contiguous()
        _rope[(n_tokens, n_heads)](qk, cos, sin, qk.stride(0), qk.stride(1), rotated // 2,
                                   BLOCK=triton.next_power_of_2(rotated // 2))
    return qk


@triton.jit
def _rope(qk_ptr, cos_ptr, sin_ptr, stride_t, stride_h, half, BLOCK: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    ok = i < half
    base = qk_ptr + token * stride_t + head * stride_h
    x1 = tl.load(base + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + token * 2 * half + i, mask=ok, other=0.0)
    cos2 = tl.load(cos_ptr + token * 2 * half + half + i, mask=ok, other=0.0)
    sin1 = tl.load(sin_ptr + token * 2 * half + i, mask=ok, other=0.0)
    sin2 = tl.load(sin_ptr + token * 2 * half + half + i, mask=ok, other=0.0)
    tl.store(base + i, (x1 * cos1 - x2 * sin1).to(qk_ptr.dtype.element_ty), mask=ok)
    tl.store(base + half + i, (x2 * cos2 + x1 * sin2).to(qk_ptr.dtype.element_ty), mask=ok)
