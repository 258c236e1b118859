"""Attention by group (tokens over only their own rows, gathered in position order) equals masked attention
over every row, and does not depend on where the rows sit in the cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvlm.memory.memory as memory_module
from kvlm.memory.memory import attention_groups
from kvlm.memory.view import TokenCells
from kvlm.model.attention import attend, attention_dtype
from kvlm.model.ops import grouped_attention


class FakeView:
    """Just what `attend` reads of a KVView: the stored rows and the groups."""

    def __init__(self, k, v, groups):
        self.k, self.v, self.groups, self.ordered = k, v, groups, False

    def read(self, layer):
        return self.k, self.v

    def groups_on(self, device):
        return self.groups


def mixed_batch(seed: int, n_rows: int = 60, cells_in_position_order: bool = False):
    """Two prefill chunks (sequences 0 and 1) and three decode tokens (sequences 2, 3, 4) in one batch."""
    rng = np.random.default_rng(seed)
    cell_seq = rng.integers(0, 5, n_rows)
    # unique positions, in no particular cell order, or rising with the cell (as a cache filled in order has them)
    cell_pos = np.arange(n_rows) if cells_in_position_order else rng.permutation(n_rows)
    token_seq = np.array([0, 0, 0, 1, 1, 2, 3, 4])
    token_pos = np.array([40, 41, 42, 40, 41, 40, 40, 40])
    visible = (cell_seq[None, :] == token_seq[:, None]) & (cell_pos[None, :] <= token_pos[:, None])
    visible[np.arange(8), np.arange(8)] = True  # each token's own cell
    return visible, np.eye(5, dtype=bool)[token_seq], cell_pos


@pytest.mark.parametrize("short_runs_per_token", [True, False])
@pytest.mark.parametrize("n_head, n_kv", [(4, 4), (8, 2), (4, 1)])
def test_attention_by_group_equals_masked_attention(n_head, n_kv, short_runs_per_token, monkeypatch):
    torch.manual_seed(1)
    visible, seq_mask, cell_pos = mixed_batch(1)
    q = torch.randn(8, n_head, 16)
    k, v = torch.randn(60, n_kv, 16), torch.randn(60, n_kv, 16)
    mask = torch.zeros(visible.shape).masked_fill_(torch.from_numpy(~visible), float("-inf"))
    expected = grouped_attention(q, k, v, mask)

    def no_copies(*args, **kwargs):
        raise AssertionError("K/V must not be repeated per query head")

    monkeypatch.setattr(torch, "repeat_interleave", no_copies)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", no_copies)
    if not short_runs_per_token:  # runs of a sequence's tokens read shared rows (as long prompt chunks do)
        monkeypatch.setattr(memory_module, "PER_TOKEN_ROWS_MAX", 1)
    groups = attention_groups(visible, seq_mask, cell_pos)
    # the decode tokens batched, each with its rows (and the two runs of 3 with them, as guesses being verified)
    assert sorted(len(g.tokens) for g in groups) == ([8] if short_runs_per_token else [2, 3, 3])
    for g in groups:
        rows = g.index.numpy().reshape(-1, g.index.shape[-1])
        real = (g.mask.numpy() == 0).reshape(rows.shape) if g.index.dim() == 2 else np.ones(rows.shape, bool)
        assert all(np.all(np.diff(cell_pos[r[ok]]) > 0) for r, ok in zip(rows, real))  # in position order
    assert torch.allclose(attend(q, 0, FakeView(k, v, groups)), expected, atol=1e-5)


@pytest.mark.parametrize("cells_in_position_order", [False, True])
@pytest.mark.parametrize("short_runs_per_token", [True, False])
def test_each_token_reads_its_visible_cells_in_position_order(short_runs_per_token, cells_in_position_order,
                                                              monkeypatch):
    """What the native attention reads (TokenCells): per token exactly the cells it sees, by position, whether its
    group shares rows (a prompt chunk) or has rows of its own (decode tokens, guesses)."""
    if not short_runs_per_token:
        monkeypatch.setattr(memory_module, "PER_TOKEN_ROWS_MAX", 1)
    for seed in range(6):
        visible, seq_mask, cell_pos = mixed_batch(seed, cells_in_position_order=cells_in_position_order)
        cells = TokenCells.of(attention_groups(visible, seq_mask, cell_pos), len(visible))
        for t in range(len(visible)):
            first = int(cells.offsets[t])
            read = cells.cells[first:first + int(cells.lengths[t])].numpy()
            seen = np.flatnonzero(visible[t])
            assert np.array_equal(read, seen[np.argsort(cell_pos[seen], kind="stable")]), (seed, t)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 8), (64, 577), (5, 4096)])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_sparse_nonzero_equals_numpys(shape, density):
    """The word-skipping nonzero the decode groups use: np.nonzero's rows and columns, in its order, at widths that
    do and do not fill whole 8-entry groups (a tail past the last one)."""
    matrix = np.random.default_rng(shape[1]).random(shape) < density
    rows, columns = memory_module._nonzero_sparse(matrix)
    expected_rows, expected_columns = np.nonzero(matrix)
    assert np.array_equal(rows, expected_rows) and np.array_equal(columns, expected_columns)


@pytest.mark.parametrize("window", [0, 16])
def test_a_prompt_chunk_shares_one_run_of_cells(window):
    """A sequence's 40 new tokens over its 50 cells (scrambled in the cache; a sliding window or not): one group
    gathering the cells once, each token's cells a run of them, from its window's start up to its own position."""
    cell_pos = np.random.default_rng(5).permutation(50)
    token_pos = np.arange(10, 50)
    visible = cell_pos[None, :] <= token_pos[:, None]
    if window:
        visible &= cell_pos[None, :] > token_pos[:, None] - window
    groups = attention_groups(visible, np.ones((40, 1), dtype=bool), cell_pos)
    assert len(groups) == 1 and groups[0].index.dim() == 1
    cells = TokenCells.of(groups, 40)
    for t, pos in enumerate(token_pos):
        first = int(cells.offsets[t])
        read = cell_pos[cells.cells[first:first + int(cells.lengths[t])].numpy()]
        assert list(read) == list(range(max(0, pos - window + 1) if window else 0, pos + 1))


def test_attention_does_not_depend_on_where_the_rows_are_stored():
    # The same rows in other cells, with other sequences' cells in between: the same groups and the same
    # computation, so the same result bit for bit (what makes a sequence's logits independent of its neighbours).
    torch.manual_seed(2)
    visible, seq_mask, cell_pos = mixed_batch(2)
    q = torch.randn(8, 4, 16)
    k, v = torch.randn(60, 2, 16), torch.randn(60, 2, 16)
    out = attend(q, 0, FakeView(k, v, attention_groups(visible, seq_mask, cell_pos)))
    moved = np.random.default_rng(3).permutation(90)[:60]  # cell c goes to cell moved[c] of a larger cache
    k2, v2 = torch.randn(90, 2, 16), torch.randn(90, 2, 16)
    k2[moved], v2[moved] = k, v
    pos2, visible2 = np.zeros(90, dtype=cell_pos.dtype), np.zeros((8, 90), dtype=bool)
    pos2[moved], visible2[:, moved] = cell_pos, visible
    assert torch.equal(attend(q, 0, FakeView(k2, v2, attention_groups(visible2, seq_mask, pos2))), out)


@pytest.mark.parametrize("q_dtype, kv_dtype, batch_invariant, expected", [
    (torch.float32, torch.bfloat16, False, torch.float32),  # a float32 model's only rounding is the cache's
    (torch.float32, torch.float16, False, torch.float32),
    (torch.float32, torch.bfloat16, True, torch.float64),  # batch-invariant: float64, whatever the cache
    (torch.float32, torch.float32, True, torch.float64),
    (torch.bfloat16, torch.bfloat16, False, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, True, torch.float64),
    (torch.bfloat16, torch.float32, False, torch.float32),
])
def test_attention_dtype(q_dtype, kv_dtype, batch_invariant, expected):
    assert attention_dtype(q_dtype, kv_dtype, batch_invariant) == expected


def test_a_smaller_cache_dtype_is_read_as_stored():
    torch.manual_seed(4)
    visible, seq_mask, cell_pos = mixed_batch(4)
    q = torch.randn(8, 4, 16)
    k, v = torch.randn(60, 2, 16).half(), torch.randn(60, 2, 16).half()
    groups = attention_groups(visible, seq_mask, cell_pos)
    out = attend(q, 0, FakeView(k, v, groups))
    assert out.dtype == torch.float32
    assert torch.equal(out, attend(q, 0, FakeView(k.float(), v.float(), groups)))
