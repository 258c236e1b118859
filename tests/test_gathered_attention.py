"""Gathered attention (each token reads only its own rows) equals masked attention over every row."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlm.memory.memory import _gather_plan, attention_groups
from kvlm.model.decoder import _attention_by_group
from kvlm.model.ops import gathered_attention, grouped_attention


@pytest.mark.parametrize("n_head, n_kv", [(4, 4), (8, 2), (4, 1)])
def test_gathered_equals_masked_attention(n_head, n_kv, monkeypatch):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    n_tokens, n_rows, dim = 6, 40, 16
    visible = rng.random((n_tokens, n_rows)) < 0.2
    visible[np.arange(n_tokens), rng.integers(0, n_rows, n_tokens)] = True  # every token sees something
    q = torch.randn(n_tokens, n_head, dim)
    k, v = torch.randn(n_rows, n_kv, dim), torch.randn(n_rows, n_kv, dim)
    mask = torch.zeros(visible.shape).masked_fill_(torch.from_numpy(~visible), float("-inf"))
    expected = grouped_attention(q, k, v, mask)

    def no_copies(*args, **kwargs):
        raise AssertionError("K/V must not be repeated per query head")

    monkeypatch.setattr(torch, "repeat_interleave", no_copies)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", no_copies)
    index, gather_mask = _gather_plan(visible, int(visible.sum(axis=1).max()))
    assert torch.allclose(gathered_attention(q, k, v, index, gather_mask), expected, atol=1e-5)


def test_attention_by_group_equals_masked_attention_for_mixed_batches():
    # Two prefill chunks (sequences 0 and 1) and three decode tokens (sequences 2, 3, 4) in one batch.
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    n_rows, n_seq, dim = 60, 5, 16
    cell_seq = rng.integers(0, n_seq, n_rows)
    cell_pos = rng.integers(0, 20, n_rows)
    token_seq = np.array([0, 0, 0, 1, 1, 2, 3, 4])
    token_pos = np.array([20, 21, 22, 20, 21, 20, 20, 20])
    visible = (cell_seq[None, :] == token_seq[:, None]) & (cell_pos[None, :] <= token_pos[:, None])
    visible[np.arange(8), np.arange(8)] = True  # each token's own cell
    seq_mask = np.eye(n_seq, dtype=bool)[token_seq]
    q = torch.randn(8, 4, dim)
    k, v = torch.randn(n_rows, 2, dim), torch.randn(n_rows, 2, dim)
    mask = torch.zeros(visible.shape).masked_fill_(torch.from_numpy(~visible), float("-inf"))
    groups = attention_groups(visible, seq_mask)
    assert sorted(len(g.tokens) for g in groups) == [2, 3, 3]
    assert torch.allclose(_attention_by_group(q, k, v, groups), grouped_attention(q, k, v, mask), atol=1e-5)


@pytest.mark.parametrize("q_dtype, kv_dtype, atol", [(torch.float32, torch.float16, 2e-3),
                                                     (torch.bfloat16, torch.bfloat16, 3e-2)])
def test_gathered_attention_over_a_smaller_cache_dtype_converts_only_what_it_reads(q_dtype, kv_dtype, atol):
    torch.manual_seed(2)
    rng = np.random.default_rng(2)
    n_tokens, n_rows, dim = 5, 50, 16
    visible = rng.random((n_tokens, n_rows)) < 0.3
    visible[:, 0] = True
    q = torch.randn(n_tokens, 4, dim)
    k, v = torch.randn(n_rows, 2, dim), torch.randn(n_rows, 2, dim)
    mask = torch.zeros(visible.shape).masked_fill_(torch.from_numpy(~visible), float("-inf"))
    expected = grouped_attention(q, k.to(kv_dtype).float(), v.to(kv_dtype).float(), mask)
    index, gather_mask = _gather_plan(visible, int(visible.sum(axis=1).max()))
    out = gathered_attention(q.to(q_dtype), k.to(kv_dtype), v.to(kv_dtype), index, gather_mask)
    assert out.dtype == q_dtype
    assert torch.allclose(out.float(), expected, atol=atol)
