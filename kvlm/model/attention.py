"""Attention of a forward pass's queries over the K/V rows its view lets them read, as the cache stores them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlm.model.ops import gathered_attention, grouped_attention

if TYPE_CHECKING:
    from kvlm.kernels.layer_ops import NativeLayerOps
    from kvlm.memory.view import KVView, MemoryView


class TracedView:
    """A view that attends itself: a compiled step's (kvlm.model.graphs.StepKV), which reads the cache's rows and the
    step's own K/V side by side in traced torch ops and writes nothing during the step."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_invariant: bool = False,
               native: NativeLayerOps | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


def attend_layer(kv: MemoryView | TracedView, layer: int, q: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None, batch_invariant: bool = False, native: NativeLayerOps | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer`'s attention through the memory's view of the micro-batch: the step's K/V [n_tokens, n_kv, d]
    written first (none for a layer reading another's: k, v None), so every token reads the stored values, then q
    over the rows the view makes visible (`native`: the native layer ops, which every token then attends through;
    `sinks`: attention sinks' logits per head, or None). `kv`: the memory's view, or a compiled step's."""
    if isinstance(kv, TracedView):
        return kv.attend(layer, q, k, v, batch_invariant, native, sinks)
    view, local = kv.layer_view(layer)
    if k is not None and getattr(native, "writes_kv", False):  # the GPU's kernel writes the rows itself
        native.write_kv(view, local, k, v)
    elif k is not None:
        view.write(local, k, v)
    return attend(q, local, view, batch_invariant, native, sinks)


def attend(q: torch.Tensor, layer: int, kv: KVView, batch_invariant: bool = False,
           native: NativeLayerOps | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, n_head, d] over the rows of `layer` that `kv` makes visible; returns [T, n_head * d] in q's dtype.
    `sinks` [n_head] float32: attention sinks' logits, or None.

    With `native` (the backend's attention kernel: the native CPU one, or the GPU's Triton one), every token attends
    in one call per layer that reads K/V in place in the cells, per token over its own cells in position order (no
    gather, no conversion; float32 softmax): with the native CPU kernel, a prompt's token computes what it would
    compute as a decode token, bit for bit. Without, torch's fused kernel per group of gathered rows."""
    if native is not None and native.takes_head_dim(q.shape[-1]):
        planes = (kv.store.k.native(layer), kv.store.v.native(layer))
        return native.attention(q.contiguous(), *planes, kv.token_cells, q.shape[-1] ** -0.5, sinks)
    keys, values = kv.read(layer)
    dtype = attention_dtype(q.dtype, keys.dtype, batch_invariant)
    q_in = q.to(dtype)
    groups = kv.groups_on(q.device)
    if kv.ordered:
        out = grouped_attention(q_in, keys.to(dtype), values.to(dtype), groups[0].mask, sinks)
    else:  # only the rows each group reads are converted
        out = _attention_by_group(q_in, keys, values, groups, sinks)
    return out.to(q.dtype)


def attention_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype, batch_invariant: bool = False) -> torch.dtype:
    """torch's attention (the reference mode, and where the native kernels are missing): a bfloat16 model attends
    over a bf16 cache in bfloat16 (the fused kernel accumulates in float32, and reads half the bytes), over any
    other cache in float32; so does a float32 model, whose only rounding is then the cache's. Batch-invariant, any
    model attends in float64: the kernel's rounding then no longer shows in the float32 result, however many tokens
    and rows one call holds (a rounding cache would turn that float32 noise into whole-ulp flips of the stored K/V,
    amplified over the layers), for about 2x the attention time."""
    if batch_invariant:
        return torch.float64
    if q_dtype == torch.bfloat16:
        return torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32
    return torch.float32


def _attention_by_group(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, groups,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for group in groups:
        q_group = q.index_select(0, group.tokens)
        if group.index.dim() == 2:
            result = gathered_attention(q_group, keys, values, group.index, group.mask, sinks)
        else:
            rows_k = keys.index_select(0, group.index).to(q.dtype)
            rows_v = values.index_select(0, group.index).to(q.dtype)
            result = grouped_attention(q_group, rows_k, rows_v, group.mask, sinks)
        out.index_copy_(0, group.tokens, result)
    return out
