"""Attention over cells in Triton: every token of a forward pass reads the cells kvlm.memory.view.TokenCells lists
for it (its sequence's, in position order, its own included: the step's K/V are written first), whether it is a
prompt's or a decode step's. A cell is one token slot (page size one), so shared prefixes, sequence copies and
rollback need nothing here.

One kernel for both, over tiles of tokens: a prompt's consecutive tokens read overlapping runs of one list of cells,
so a tile of them loads each K/V row once for all its tokens (causality is each token's run length); a decode
token, whose run is its own, is a tile alone. A program takes one tile and one KV head, its query heads together
(GQA: the group's heads are rows of one product), and one split of the tile's cells; a second kernel adds the
splits up (with the sinks' logits). The products take float32 operands exactly ("ieee", not TF32: the softmax
weights and an f32 or q8_0 cache would lose ~5e-4 of their precision there); a step is bound by reading the cells. Long decode runs are split so that a batch of one still fills the GPU
(SGLang's and vLLM's split-KV decode); the host chooses the split count from the lengths it already knows.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvlm.kernels.gpu.reference import Q8_BLOCK

MIN_DOT = 16  # a GPU's tl.dot needs every side >= 16
CELLS_PER_SPLIT = 256  # a split's share of a long run: fewer splits waste nothing on short ones


def attention(q: torch.Tensor, k_plane: tuple, v_plane: tuple, cells, scale: float,
              sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """q [T, n_head, d] (contiguous) over the cells each token reads (`cells`: TokenCells on q's device) of the K and
    V planes (`(data [cells, n_kv, d], q8 scales or None)`, as KVPlane.native gives them); [T, n_head * d] in q's
    dtype. `sinks` [n_head] float32 or None; `softcap` > 0 caps the scores (cap * tanh(s / cap)). The tiles are
    planned on the host from the offsets and lengths the memory made there (TokenCells.host), without waiting for
    the device."""
    n_tokens, n_head, dim = q.shape
    (k, k_scales), (v, v_scales) = k_plane, v_plane
    n_kv = k.shape[1]
    group = n_head // n_kv
    block_g = triton.next_power_of_2(group)
    block_m = max(1, MIN_DOT // block_g)  # tokens per tile: the rows of a product are block_m x block_g
    key = ("attention", block_m)
    if key not in cells.plans:  # once per view: every layer reads the same cells
        cells.plans[key] = (plan_per_token(n_tokens, cells.fixed_splits, q.device) if cells.fixed_splits
                            else plan_tiles(*cells.on_host(), block_m, q.device))
    tile_table, n_tiles, n_splits = cells.plans[key]
    out = torch.empty(n_tokens, n_head * dim, dtype=q.dtype, device=q.device)
    # one split: each program finishes its rows' softmax itself; more: partial results, then _reduce_splits
    parts = (torch.empty(n_splits, n_tokens, n_head, dim + 2, dtype=torch.float32, device=q.device)
             if n_splits > 1 else out)
    q8 = k_scales is not None
    block_d = max(MIN_DOT, triton.next_power_of_2(dim))
    sink_logits = sinks if sinks is not None else out
    _attend_tile[(n_tiles, n_kv, n_splits)](
        q, k, v, k_scales if q8 else k, v_scales if q8 else v, cells.cells, cells.offsets, cells.lengths,
        tile_table, parts, sink_logits, out, scale, softcap, group, dim, n_head, n_tokens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), (k_scales if q8 else k).stride(0),
        (k_scales if q8 else k).stride(1),
        Q8=q8, SOFTCAP=softcap > 0, SINKS=sinks is not None, SPLIT=n_splits > 1, BLOCK_M=block_m,
        BLOCK_G=block_g, BLOCK_N=32 if block_d <= 128 else 16, BLOCK_D=block_d, Q8_BLOCK=Q8_BLOCK)
    if n_splits > 1:
        _reduce_splits[(n_tokens,)](parts, sink_logits, out, n_splits, n_tokens, n_head, dim,
                                    SINKS=sinks is not None, BLOCK_H=triton.next_power_of_2(n_head), BLOCK_D=block_d)
    return out


def plan_tiles(offsets: np.ndarray, lengths: np.ndarray, block_m: int,
               device: torch.device | str) -> tuple[torch.Tensor, int, int]:
    """(tile table [n_tiles, 2] of first token and token count on `device`, n_tiles, splits): consecutive tokens
    whose runs overlap (a prompt's) share tiles of up to `block_m`; a token whose run does not overlap the one
    before it (a decode token, a new sequence) starts a tile. Splits: one per CELLS_PER_SPLIT cells of the longest
    run, at most 16."""
    n = len(offsets)
    ends = offsets + lengths
    joins = np.zeros(n, dtype=bool)
    joins[1:] = (offsets[1:] < ends[:-1]) & (ends[1:] > offsets[:-1])
    run_first = np.maximum.accumulate(np.where(joins, 0, np.arange(n)))
    starts = ~joins | ((np.arange(n) - run_first) % block_m == 0)
    firsts = np.flatnonzero(starts)
    counts = np.diff(np.append(firsts, n))
    table = torch.from_numpy(np.stack([firsts, counts], axis=1).astype(np.int64)).to(device)
    longest = int(lengths.max()) if n else 1
    return table, len(firsts), int(min(16, max(1, -(-longest // CELLS_PER_SPLIT))))


def plan_per_token(n_tokens: int, n_splits: int, device: torch.device | str) -> tuple[torch.Tensor, int, int]:
    """plan_tiles' plan for a CUDA graph's step, made without reading the lengths: a tile per token, `n_splits`
    splits of every run (a split past a run's end finds no cell, and adds nothing)."""
    firsts = torch.arange(n_tokens, dtype=torch.int64, device=device)
    return torch.stack((firsts, torch.ones_like(firsts)), dim=1), n_tokens, n_splits


@triton.jit
def _tanh(x):
    """tanh from exp (the interpreter has no libdevice): 1 - 2 / (e^2x + 1), exact at both infinities."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_tile(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, cells_ptr, offsets_ptr, lengths_ptr, tiles_ptr, parts_ptr,
                 sinks_ptr, out_ptr, scale, softcap, group, head_dim, n_head, n_tokens,
                 stride_qt, stride_qh, stride_kc, stride_kh, stride_sc, stride_sh,
                 Q8: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 Q8_BLOCK: tl.constexpr):
    """One split of one tile's cells for one KV head. SPLIT: each row's running max, sum and weighted values into
    parts [split, token, head, d + 2] (values, then max, then sum); else the rows' outputs, sinks joined."""
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_splits = tl.num_programs(2)
    first = tl.load(tiles_ptr + 2 * tile)
    count = tl.load(tiles_ptr + 2 * tile + 1)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    g = r % BLOCK_G
    row_ok = (r // BLOCK_G < count) & (g < group)
    token = first + r // BLOCK_G
    head = kv_head * group + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    start = tl.load(offsets_ptr + token, mask=row_ok, other=0)
    end = start + tl.load(lengths_ptr + token, mask=row_ok, other=0)
    lo = tl.min(tl.where(row_ok, start, 1 << 62), axis=0)
    hi = tl.max(tl.where(row_ok, end, 0), axis=0)
    share = tl.cdiv(tl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
    split_lo = lo + split * share
    split_hi = tl.minimum(hi, split_lo + share)
    running_max = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for j0 in range(split_lo, split_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < split_hi
        cell = tl.load(cells_ptr + j, mask=j_ok, other=0)
        kv_mask = j_ok[:, None] & d_ok[None, :]
        row = cell[:, None] * stride_kc + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + row, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row, mask=kv_mask, other=0.0).to(tl.float32)
        if Q8:
            block = cell[:, None] * stride_sc + kv_head * stride_sh + (d // Q8_BLOCK)[None, :]
            k = k * tl.load(ks_ptr + block, mask=kv_mask, other=0.0).to(tl.float32)
            v = v * tl.load(vs_ptr + block, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        visible = row_ok[:, None] & (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        base = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing visible yet
        weights = tl.exp(scores - base[:, None])
        rescale = tl.exp(running_max - base)
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
        running_max = new_max
    if SPLIT:
        part = ((split * n_tokens + token) * n_head + head) * (head_dim + 2)
        tl.store(parts_ptr + part[:, None] + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(parts_ptr + part + head_dim, running_max, mask=row_ok)
        tl.store(parts_ptr + part + head_dim + 1, running_sum, mask=row_ok)
    else:
        if SINKS:  # one more logit, with no value
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            new_max = tl.maximum(running_max, sink)
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.exp(sink - new_max)
            acc = acc * rescale[:, None]
        out = acc / tl.where(row_ok, running_sum, 1.0)[:, None]
        tl.store(out_ptr + (token * n_head + head)[:, None] * head_dim + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _reduce_splits(parts_ptr, sinks_ptr, out_ptr, n_splits, n_tokens, n_head, head_dim,
                   SINKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's heads (the rows): its splits' partial softmaxes added up, with each head's sink logit (no value)."""
    token = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < n_head
    ok = h_ok[:, None] & (d < head_dim)[None, :]
    total_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if SINKS:
        total_max = tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    for split in range(n_splits):
        part = ((split * n_tokens + token) * n_head + h) * (head_dim + 2)
        total_max = tl.maximum(total_max, tl.load(parts_ptr + part + head_dim, mask=h_ok, other=float("-inf")))
    total_sum = tl.zeros([BLOCK_H], tl.float32)
    if SINKS:
        total_sum = tl.exp(tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32) - total_max)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(n_splits):
        part = ((split * n_tokens + token) * n_head + h) * (head_dim + 2)
        split_max = tl.load(parts_ptr + part + head_dim, mask=h_ok, other=float("-inf"))
        weight = tl.where(split_max == float("-inf"), 0.0, tl.exp(split_max - total_max))
        total_sum += tl.load(parts_ptr + part + head_dim + 1, mask=h_ok, other=0.0) * weight
        acc += tl.load(parts_ptr + part[:, None] + d[None, :], mask=ok, other=0.0) * weight[:, None]
    out = acc / tl.where(h_ok, total_sum, 1.0)[:, None]
    tl.store(out_ptr + (token * n_head + h[:, None]) * head_dim + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok)
