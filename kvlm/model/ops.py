"""The decoder's building blocks as plain functions over torch tensors."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # torch's fused kernel accumulates in float32 for bf16 too, as transformers' upcast does.
    return F.rms_norm(x, weight.shape, weight, eps)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of q [T, n_head, d] over k, v [S, n_head_kv, d]; returns [T, n_head * d].

    Query heads are grouped contiguously: heads g*j .. g*j + g-1 read KV head j. The heads of a group
    are stacked as extra query rows over their shared KV head, so K and V are never copied per query
    head. `mask` is additive [T, S] (0 or -inf) or None when every row is visible to every query.
    torch's fused CPU kernel runs 2-3x faster than separate matmuls and softmax on prompt chunks.
    `sinks` [n_head]: each head's sink logit (see with_sinks), or None.
    """
    n_tokens, n_head, dim = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    # [1, n_kv, group * T, d]: the heads of one group stacked along the rows.
    q_grouped = q.permute(1, 0, 2).reshape(1, n_kv, group * n_tokens, dim)
    mask = None if mask is None else torch.cat((_in_dtype(mask, q),) * group)  # rows of the stacked heads
    keys, values = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]
    if sinks is not None:  # each stacked row's head: row r of KV head j is head j * group + r // T
        if mask is None:
            mask = q.new_zeros(group * n_tokens, k.shape[0])
        row_sinks = sinks.view(1, n_kv, group, 1).expand(1, n_kv, group, n_tokens).reshape(1, n_kv, -1, 1)
        keys, values, mask = with_sinks(keys, values, mask.expand(1, n_kv, *mask.shape), row_sinks.to(q.dtype))
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=mask)
    return out.view(n_head, n_tokens, dim).permute(1, 0, 2).reshape(n_tokens, n_head * dim)


def gathered_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor, mask: torch.Tensor,
    sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of each token over only its own rows: index [T, L] picks them from k, v [S, n_kv, d].

    For many short sequences in one batch this is far less work than masking every cell for every
    token. Rows are gathered once per token, never per query head: each token is a batch entry of the
    fused kernel, its KV heads the heads and the group of query heads sharing one the query rows.
    `mask` [T, L] is additive (-inf on padding). K and V may be stored in another dtype than q: only
    the gathered rows are converted. `sinks` [n_head]: each head's sink logit (see with_sinks), or None.
    """
    n_tokens, n_head, dim = q.shape
    n_kv, group = k.shape[1], n_head // k.shape[1]
    rows = index.shape + k.shape[1:]  # index_select is several times faster than k[index] here
    keys = k.index_select(0, index.flatten()).view(rows).to(q.dtype).transpose(1, 2)  # [T, n_kv, L, d]
    values = v.index_select(0, index.flatten()).view(rows).to(q.dtype).transpose(1, 2)
    mask = _in_dtype(mask, q)[:, None, None, :]
    if sinks is not None:
        full = mask.expand(n_tokens, n_kv, group, mask.shape[-1])
        keys, values, mask = with_sinks(keys, values, full, sinks.view(1, n_kv, group, 1).to(q.dtype))
    out = F.scaled_dot_product_attention(q.view(n_tokens, n_kv, group, dim), keys, values, attn_mask=mask)
    return out.reshape(n_tokens, n_head * dim)


def with_sinks(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               row_sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: a zero key and zero value row after the others, whose score is
    then the mask's value, the query row's sink logit. It joins the softmax's denominator and adds nothing to the
    output, which is what a sink is. keys, values [..., L, d]; mask [..., rows, L] additive; row_sinks broadcast to
    [..., rows, 1]."""
    zero = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])
    sink_column = row_sinks.expand(*mask.shape[:-1], 1)
    return torch.cat((keys, zero), dim=-2), torch.cat((values, zero), dim=-2), torch.cat((mask, sink_column), dim=-1)


def attention_with_own_rows(
    q: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
    sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of B sequences' T new tokens each over L cached rows per sequence and their own K/V.

    q [B, T, n_head, d]; old_k, old_v [B, L, n_kv, d]; k, v [B, T, n_kv, d]; mask additive [B, T, L + T] in
    q's dtype; `sinks` [n_head] or None. Returns [B * T, n_head * d]. A pure function of its inputs: what a compiled
    graph can hold.
    """
    batch, n_new, n_head, dim = q.shape
    n_kv = k.shape[2]
    group = n_head // n_kv
    keys = torch.cat((old_k, k), dim=1).transpose(1, 2)  # [B, n_kv, L + T, d]
    values = torch.cat((old_v, v), dim=1).transpose(1, 2)
    # The heads of a group stacked as query rows over their shared KV head, as in grouped_attention.
    q_grouped = q.view(batch, n_new, n_kv, group, dim).permute(0, 2, 3, 1, 4).reshape(batch, n_kv, group * n_new, dim)
    mask = mask.repeat(1, group, 1)[:, None]
    if sinks is not None:  # as in grouped_attention
        row_sinks = sinks.view(1, n_kv, group, 1).expand(1, n_kv, group, n_new).reshape(1, n_kv, -1, 1)
        full = mask.expand(batch, n_kv, *mask.shape[2:])
        keys, values, mask = with_sinks(keys, values, full, row_sinks.to(q.dtype))
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=mask)
    return out.view(batch, n_kv, group, n_new, dim).permute(0, 3, 1, 2, 4).reshape(batch * n_new, n_head * dim)


def _in_dtype(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The fused kernel wants an additive mask in the query's dtype (0 and -inf survive any float dtype)."""
    return mask if mask.dtype == q.dtype else mask.to(q.dtype)
