"""RMSNorm (with the residual add) and RoPE in Triton. Each computes in float32 and rounds once at the end, as kvlm's
native CPU ops do. On a GPU a program takes one row (a token's heads, for RoPE); through Triton's interpreter, whose
cost is per program, a norm's program takes 16 rows."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x [rows, n] (contiguous); without `residual` the second is
    x itself. The sum is rounded to x's dtype before it is normed (it is the residual stream)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    if rows:
        _rms_norm[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
            x, residual if residual is not None else x, weight, out, total, rows, n, eps,
            RESIDUAL=residual is not None, ROWS=ROWS_PER_PROGRAM, BLOCK=triton.next_power_of_2(n))
    return out, total


@triton.jit
def _rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, total_ptr, rows, n, eps, RESIDUAL: tl.constexpr,
              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK)
    ok = (row < rows)[:, None] & (i < n)[None, :]
    at = row[:, None] * n + i[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        x += tl.load(residual_ptr + at, mask=ok, other=0.0).to(tl.float32)
        x = x.to(total_ptr.dtype.element_ty)
        tl.store(total_ptr + at, x, mask=ok)
        x = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)
    weight = tl.load(weight_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, (x * inverse[:, None] * weight[None, :]).to(out_ptr.dtype.element_ty), mask=ok)


def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk [T, heads, d] (its last two dimensions contiguous) rotated in place by float32 cos, sin [T, 1, r]: the
    pairs (i, i + r/2) of each head's first r dims (r < d: partial RoPE), the rest untouched. Returns qk."""
    n_tokens, n_heads, dim = qk.shape
    rotated = cos.shape[-1]
    if n_tokens:
        cos, sin = cos.reshape(n_tokens, rotated).contiguous(), sin.reshape(n_tokens, rotated).contiguous()
        _rope[(n_tokens,)](qk, cos, sin, qk.stride(0), n_heads, dim, rotated // 2,
                           BLOCK_H=triton.next_power_of_2(n_heads), BLOCK=triton.next_power_of_2(rotated // 2))
    return qk


@triton.jit
def _rope(qk_ptr, cos_ptr, sin_ptr, stride_t, n_heads, head_dim, half, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    """One token's heads: rows of the block are heads, columns the first half's dimensions."""
    token = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK)
    ok = (h < n_heads)[:, None] & (i < half)[None, :]
    first = qk_ptr + token * stride_t + h[:, None] * head_dim + i[None, :]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=ok, other=0.0).to(tl.float32)
    table = token * 2 * half + i
    cos1 = tl.load(cos_ptr + table, mask=i < half, other=0.0)[None, :]
    cos2 = tl.load(cos_ptr + table + half, mask=i < half, other=0.0)[None, :]
    sin1 = tl.load(sin_ptr + table, mask=i < half, other=0.0)[None, :]
    sin2 = tl.load(sin_ptr + table + half, mask=i < half, other=0.0)[None, :]
    tl.store(first, (x1 * cos1 - x2 * sin1).to(qk_ptr.dtype.element_ty), mask=ok)
    tl.store(first + half, (x2 * cos2 + x1 * sin2).to(qk_ptr.dtype.element_ty), mask=ok)
