"""The plain torch computations the Triton kernels (kvlm.kernels.gpu) are tested against: one token, one row at a
time, in float32, written to be read rather than to be fast."""
from __future__ import annotations

import torch

Q8_BLOCK = 32  # kvlm.memory.kv_store's q8_0 block along head_dim


def plane_values(plane: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """A K or V plane `(data [cells, n_kv, d], q8 scales [cells, n_kv, d / 32] or None)` as float32 values."""
    data, scales = plane
    if scales is None:
        return data.float()
    return (data.float().unflatten(-1, (-1, Q8_BLOCK)) * scales.float()[..., None]).flatten(-2)


def cell_attention(q: torch.Tensor, k_plane: tuple, v_plane: tuple, cells, scale: float,
                   sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q [T, n_head, d] over the cells each token reads (kvlm.memory.view.TokenCells); [T, n_head * d] in q's dtype.
    Head h reads KV head h // (n_head / n_kv); scores are softcapped (cap * tanh(s / cap)) where `softcap` > 0;
    `sinks` [n_head] joins each head's softmax as one more logit with no value."""
    keys, values = plane_values(k_plane), plane_values(v_plane)
    n_tokens, n_head, _ = q.shape
    group = n_head // keys.shape[1]
    out = []
    for t in range(n_tokens):
        start, length = int(cells.offsets[t]), int(cells.lengths[t])
        rows = cells.cells[start:start + length]
        k = keys[rows].repeat_interleave(group, dim=1)  # [L, n_head, d]
        v = values[rows].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].float(), k) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        weights = torch.softmax(scores, dim=1)[:, :length]
        out.append(torch.einsum("hl,lhd->hd", weights, v).reshape(-1))
    return torch.stack(out).to(q.dtype)


def kv_write(plane: tuple, rows: torch.Tensor, values: torch.Tensor) -> None:
    """values [n, n_kv, d] into the cells `rows` of a plane, as kvlm.memory.kv_store writes them (q8_0: each block of
    32 scaled by its largest magnitude / 127, rounded half to even, the scale kept as float16)."""
    data, scales = plane
    if scales is None:
        data[rows] = values.to(data.dtype)
        return
    blocks = values.float().unflatten(-1, (-1, Q8_BLOCK))
    scale = blocks.abs().amax(-1) / 127
    quants = torch.round(blocks / scale.clamp_min(1e-30)[..., None]).clamp_(-127, 127)
    data[rows] = quants.flatten(-2).to(torch.int8)
    scales[rows] = scale.to(torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) in x's dtype, the sum rounded to it first; x [rows, n]."""
    total = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    values = total.float()
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), total


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qk [T, heads, d] rotated (the pairs (i, i + r/2) of its first r dims, r = cos's width) by float32 cos, sin
    [T, 1, r] (each half repeated, as kvlm.core.rope makes them); the other dims as they are."""
    r = cos.shape[-1]
    x = qk[..., :r].float()
    rotated = torch.cat([-x[..., r // 2:], x[..., :r // 2]], dim=-1)
    out = qk.clone()
    out[..., :r] = (x * cos + rotated * sin).to(qk.dtype)
    return out
