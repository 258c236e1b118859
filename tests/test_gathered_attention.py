"""Gathered attention (each token reads only its own rows) equals masked attention over every row."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlm.memory.memory import _gather_plan
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
