"""Attention of a forward pass's queries over the K/V rows its view lets them read, as the cache stores them."""
from __future__ import annotations

import torch

from kvlm.memory.view import KVView
from kvlm.model.ops import gathered_attention, grouped_attention


def attend(q: torch.Tensor, layer: int, kv: KVView) -> torch.Tensor:
    """q [T, n_head, d] over the rows of `layer` that `kv` makes visible; returns [T, n_head * d]."""
    keys, values = kv.read(layer)
    dtype = attention_dtype(keys.dtype)
    q = q.to(dtype)
    if kv.groups is None:
        return grouped_attention(q, keys.to(dtype), values.to(dtype), kv.mask)
    return _attention_by_group(q, keys, values, kv.groups)  # only the rows each group reads are converted


def attention_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """bfloat16 caches are attended in bfloat16 (the fused kernel accumulates in float32, and reads half
    the bytes); every other cache in float32, which is exact for an f32 cache."""
    return torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32


def _attention_by_group(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, groups) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for group in groups:
        q_group = q.index_select(0, group.tokens)
        if group.index.dim() == 2:
            result = gathered_attention(q_group, keys, values, group.index, group.mask)
        else:
            rows_k = keys.index_select(0, group.index).to(q.dtype)
            rows_v = values.index_select(0, group.index).to(q.dtype)
            result = grouped_attention(q_group, rows_k, rows_v, group.mask)
        out.index_copy_(0, group.tokens, result)
    return out
