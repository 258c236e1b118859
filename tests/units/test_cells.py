"""Cells: a stateful test against a naive multiset reference, and hand-made layouts."""
from __future__ import annotations

import copy
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlm.memory.cells import Cells


class Entry:
    """One used cell of the reference, without an index: slot choice is an implementation detail."""

    def __init__(self, pos: int, seqs: set[int]) -> None:
        self.pos, self.seqs, self.shift = pos, set(seqs), 0

    def key(self) -> tuple[int, frozenset[int], int]:
        return self.pos, frozenset(self.seqs), self.shift


def in_range(pos: int, p0: int, p1: int) -> bool:
    return pos >= max(p0, 0) and (p1 < 0 or pos < p1)


def multiset(cells: Cells) -> Counter:
    return Counter(
        (int(cells.pos[i]), frozenset(np.flatnonzero(cells.seqs[i]).tolist()), int(cells.shift[i]))
        for i in np.flatnonzero(cells.pos >= 0)
    )


def state(cells: Cells) -> tuple:
    return cells.pos.copy(), cells.seqs.copy(), cells.shift.copy(), cells.head


def assert_same_state(a: tuple, b: tuple) -> None:
    for x, y in zip(a[:3], b[:3]):
        np.testing.assert_array_equal(x, y)
    assert a[3] == b[3]


def ubatch(n_seq_max: int):
    """(positions, seq_mask) of 1..6 tokens; a token may belong to several sequences."""
    token = st.tuples(
        st.integers(0, 40), st.sets(st.integers(0, n_seq_max - 1), min_size=1, max_size=n_seq_max)
    )
    return st.lists(token, min_size=1, max_size=6).map(lambda tokens: to_arrays(tokens, n_seq_max))


def to_arrays(tokens, n_seq_max):
    positions = np.array([p for p, _ in tokens], dtype=np.int64)
    mask = np.zeros((len(tokens), n_seq_max), dtype=bool)
    for i, (_, seqs) in enumerate(tokens):
        mask[i, sorted(seqs)] = True
    return positions, mask


class CellsMachine(RuleBasedStateMachine):
    @initialize(n_cells=st.integers(8, 32), n_seq_max=st.integers(1, 6))
    def setup(self, n_cells, n_seq_max):
        self.cells = Cells(n_cells, n_seq_max)
        self.ref: list[Entry] = []

    def seq(self):
        return st.integers(0, self.cells.n_seq_max - 1)

    def place(self, data) -> bool:
        positions, mask = data.draw(ubatch(self.cells.n_seq_max))
        free_before = self.cells.n_cells - self.cells.n_used
        before = state(self.cells)
        slot = self.cells.find_slot(len(positions))
        if slot is None:
            assert free_before < len(positions)
            assert_same_state(state(self.cells), before)
            return False
        assert len(set(slot.tolist())) == len(positions)
        assert (self.cells.pos[slot] == -1).all()
        self.cells.apply(slot, positions, mask)
        self.ref += [Entry(int(p), set(np.flatnonzero(m).tolist())) for p, m in zip(positions, mask)]
        return True

    @rule(data=st.data())
    def find_slot_and_apply(self, data):
        self.place(data)

    @rule(data=st.data(), n_ubatches=st.integers(1, 3))
    def dry_run_then_roll_back(self, data, n_ubatches):
        before, ref = state(self.cells), copy.deepcopy(self.ref)
        snapshot = self.cells.copy()
        for _ in range(n_ubatches):
            self.place(data)
        self.cells.seq_rm(-1, 0, 5)
        assert_same_state(state(snapshot), before)  # the copy shares no array with the planned state
        self.cells, self.ref = snapshot, ref

    @rule(data=st.data(), p0=st.integers(-3, 45), p1=st.integers(-3, 45))
    def seq_rm(self, data, p0, p1):
        seq_id = data.draw(st.integers(-1, self.cells.n_seq_max - 1))
        assert self.cells.seq_rm(seq_id, p0, p1) is True
        for e in self.ref:
            if in_range(e.pos, p0, p1):
                e.seqs = set() if seq_id == -1 else e.seqs - {seq_id}
        self.ref = [e for e in self.ref if e.seqs]

    @rule(data=st.data(), p0=st.integers(-3, 45), p1=st.integers(-3, 45))
    def seq_cp(self, data, p0, p1):
        src, dst = data.draw(self.seq()), data.draw(self.seq())
        self.cells.seq_cp(src, dst, p0, p1)
        for e in self.ref:
            if src in e.seqs and in_range(e.pos, p0, p1):
                e.seqs.add(dst)

    @rule(data=st.data())
    def seq_keep(self, data):
        seq_id = data.draw(self.seq())
        self.cells.seq_keep(seq_id)
        self.ref = [e for e in self.ref if seq_id in e.seqs]
        for e in self.ref:
            e.seqs = {seq_id}

    @rule(data=st.data(), p0=st.integers(-3, 45), p1=st.integers(-3, 45), delta=st.integers(-30, 30))
    def seq_add(self, data, p0, p1, delta):
        seq_id = data.draw(self.seq())
        self.cells.seq_add(seq_id, p0, p1, delta)
        for e in self.ref:
            if seq_id in e.seqs and in_range(e.pos, p0, p1):
                e.pos += delta
                e.shift += delta
        self.ref = [e for e in self.ref if e.pos >= 0]

    @rule(data=st.data(), p0=st.integers(-3, 45), p1=st.integers(-3, 45), d=st.integers(1, 4))
    def seq_div(self, data, p0, p1, d):
        seq_id = data.draw(self.seq())
        self.cells.seq_div(seq_id, p0, p1, d)
        for e in self.ref:
            if seq_id in e.seqs and in_range(e.pos, p0, p1):
                e.shift += e.pos // d - e.pos
                e.pos //= d

    @rule()
    def clear(self):
        self.cells.clear()
        self.ref = []
        assert self.cells.head == 0

    @rule()
    def compact(self):
        order = [(self.cells.pos[i], self.cells.seqs[i].tolist()) for i in np.flatnonzero(self.cells.pos >= 0)]
        for src, dst in self.cells.compaction_moves():
            self.cells.move(src, dst)
        used = np.flatnonzero(self.cells.pos >= 0)
        np.testing.assert_array_equal(used, np.arange(len(order)))
        assert [(self.cells.pos[i], self.cells.seqs[i].tolist()) for i in used] == order
        assert self.cells.compaction_moves() == []

    @rule()
    def take_shifts(self):
        cells, deltas = self.cells.take_shifts()
        taken = Counter(
            (int(self.cells.pos[i]), frozenset(np.flatnonzero(self.cells.seqs[i]).tolist()), int(d))
            for i, d in zip(cells, deltas)
        )
        assert taken == Counter(e.key() for e in self.ref if e.shift != 0)
        assert (deltas != 0).all()
        for e in self.ref:
            e.shift = 0
        assert not self.cells.has_shift

    @rule(data=st.data())
    def visibility_matches_a_loop(self, data):
        positions, mask = data.draw(ubatch(self.cells.n_seq_max))
        n_kv = data.draw(st.integers(self.cells.used_max, self.cells.n_cells))
        vis = self.cells.visibility(positions, mask, n_kv)
        assert vis.shape == (len(positions), n_kv) and vis.dtype == bool
        for i in range(len(positions)):
            for j in range(n_kv):
                shares = (self.cells.seqs[j] & mask[i]).any()
                expected = self.cells.pos[j] >= 0 and shares and self.cells.pos[j] <= positions[i]
                assert vis[i, j] == expected

    @invariant()
    def matches_reference(self):
        c = self.cells
        assert c.n_used == len(self.ref)
        assert multiset(c) == Counter(e.key() for e in self.ref)
        assert c.has_shift == any(e.shift for e in self.ref)
        for s in range(c.n_seq_max):
            positions = [e.pos for e in self.ref if s in e.seqs]
            assert c.seq_pos_min(s) == (min(positions) if positions else -1)
            assert c.seq_pos_max(s) == (max(positions) if positions else -1)
            assert sorted(positions) == c.pos[c.seq_cells(s)].tolist()

    @invariant()
    def cells_are_consistent(self):
        c = self.cells
        assert c.seqs.shape == (c.n_cells, c.n_seq_max)
        empty = c.pos < 0
        assert (c.pos[empty] == -1).all() and not c.seqs[empty].any() and not c.shift[empty].any()
        assert c.seqs[~empty].any(axis=1).all()
        used = np.flatnonzero(~empty)
        assert c.used_max == (used[-1] + 1 if used.size else 0) >= c.n_used
        assert 0 <= c.head < c.n_cells


CellsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCellsMachine = CellsMachine.TestCase


def one_seq(n_tokens: int, n_seq_max: int, seq_id: int = 0) -> np.ndarray:
    mask = np.zeros((n_tokens, n_seq_max), dtype=bool)
    mask[:, seq_id] = True
    return mask


def filled(n_cells: int, n_seq_max: int = 2, n_tokens: int | None = None) -> Cells:
    """Sequence 0 at positions 0.. in cells 0.."""
    cells = Cells(n_cells, n_seq_max)
    n = n_cells if n_tokens is None else n_tokens
    cells.apply(np.arange(n), np.arange(n), one_seq(n, n_seq_max))
    return cells


def test_find_slot_takes_scattered_free_cells():
    cells = filled(10)
    cells.seq_rm(0, 2, 3)
    cells.seq_rm(0, 5, 7)
    cells.seq_rm(0, 9, 10)
    slot = cells.find_slot(4)
    assert sorted(slot.tolist()) == [2, 5, 6, 9]
    cells.apply(slot, np.arange(10, 14), one_seq(4, 2))
    assert cells.n_used == 10


def test_find_slot_searches_from_head_and_wraps():
    cells = filled(8, n_tokens=6)
    cells.seq_rm(0, 0, 1)                  # frees cell 0, before head
    assert cells.find_slot(2).tolist() == [0, 6]
    cells.apply(np.array([6]), np.array([6]), one_seq(1, 2))
    assert cells.find_slot(2).tolist() == [7, 0]


def test_find_slot_when_full_returns_none_and_changes_nothing():
    cells = filled(6)
    before = state(cells)
    assert cells.find_slot(1) is None
    assert_same_state(state(cells), before)
    cells.seq_rm(0, 5, -1)
    assert cells.find_slot(2) is None and cells.find_slot(1).tolist() == [5]


def test_visibility_on_a_hand_made_layout():
    # cell 0: position 0 shared by sequences 0 and 1; cell 1: empty; cell 2: sequence 0 at 1;
    # cell 3: sequence 1 at 1; cell 4: sequence 0 at 5 (a future position for the tokens below)
    cells = Cells(6, 2)
    cells.apply(np.array([0, 2, 3, 4]), np.array([0, 1, 1, 5]),
                np.array([[True, True], [True, False], [False, True], [True, False]]))
    vis = cells.visibility(np.array([2, 2, 0]), np.array([[True, False], [False, True], [True, True]]), 6)
    np.testing.assert_array_equal(vis, np.array([
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 0],
    ], dtype=bool))
    assert cells.visibility(np.array([9]), np.array([[True, False]]), 3).tolist() == [[True, False, True]]


def test_seq_add_below_zero_frees_the_whole_sequence():
    cells = filled(8, n_tokens=5)
    cells.apply(np.array([5]), np.array([0]), one_seq(1, 2, seq_id=1))
    cells.seq_add(0, -1, -1, -5)
    assert cells.n_used == 1 and cells.seq_pos_min(0) == cells.seq_pos_max(0) == -1
    assert cells.seq_cells(0).size == 0 and not cells.has_shift
    assert cells.seq_pos_max(1) == 0


def test_seq_add_moves_every_sequence_of_a_shared_cell():
    cells = filled(4, n_tokens=3)
    cells.seq_cp(0, 1, 0, 1)
    cells.seq_add(0, 0, -1, 10)
    assert cells.seq_pos_min(1) == 10
    assert cells.take_shifts()[1].tolist() == [10, 10, 10]


def test_seq_div_exact_values():
    cells = filled(10)
    cells.seq_div(0, -1, -1, 2)
    assert cells.pos.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    idx, deltas = cells.take_shifts()
    assert idx.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert deltas.tolist() == [-1, -1, -2, -2, -3, -3, -4, -4, -5]  # new - old: llama.cpp stores old - new

    cells = filled(10)
    cells.seq_div(0, 4, 8, 3)
    assert cells.pos.tolist() == [0, 1, 2, 3, 1, 1, 2, 2, 8, 9]
    assert cells.shift.tolist() == [0, 0, 0, 0, -3, -4, -4, -5, 0, 0]
    cells.seq_div(0, 0, -1, 1)
    assert cells.shift.tolist() == [0, 0, 0, 0, -3, -4, -4, -5, 0, 0]


def test_seq_keep_and_seq_rm_all_sequences():
    cells = filled(6, n_tokens=4)
    cells.seq_cp(0, 1, 1, 3)
    cells.seq_keep(1)
    assert cells.pos.tolist() == [-1, 1, 2, -1, -1, -1]
    assert cells.seqs[1].tolist() == cells.seqs[2].tolist() == [False, True]
    cells.seq_rm(-1, -5, -5)
    assert cells.n_used == 0 and cells.used_max == 0


def test_copy_is_deep():
    cells = filled(4, n_tokens=2)
    other = cells.copy()
    other.seq_add(0, 0, -1, 1)
    other.apply(np.array([3]), np.array([7]), one_seq(1, 2, 1))
    assert cells.pos.tolist() == [0, 1, -1, -1] and not cells.has_shift and not cells.seqs[:, 1].any()


@pytest.mark.parametrize("call, message", [
    (lambda c: c.seq_pos_min(20), "seq_id 20 is outside [0, 16)"),
    (lambda c: c.seq_pos_max(-1), "seq_id -1 is outside [0, 16)"),
    (lambda c: c.seq_cells(16), "seq_id 16 is outside [0, 16)"),
    (lambda c: c.seq_rm(-2, 0, -1), "seq_id -2 is outside [-1, 16)"),
    (lambda c: c.seq_rm(16, 0, -1), "seq_id 16 is outside [-1, 16)"),
    (lambda c: c.seq_cp(0, 17, 0, -1), "seq_id 17 is outside [0, 16)"),
    (lambda c: c.seq_cp(-1, 0, 0, -1), "seq_id -1 is outside [0, 16)"),
    (lambda c: c.seq_keep(16), "seq_id 16 is outside [0, 16)"),
    (lambda c: c.seq_add(16, 0, -1, 0), "seq_id 16 is outside [0, 16)"),
    (lambda c: c.seq_div(-1, 0, -1, 2), "seq_id -1 is outside [0, 16)"),
    (lambda c: c.seq_div(0, 0, -1, 0), "divisor d must be >= 1, got 0"),
    (lambda c: c.find_slot(0), "n_tokens must be >= 1, got 0"),
    (lambda c: c.visibility(np.array([0]), one_seq(1, 16), 33), "n_kv 33 is outside [0, 32]"),
    (lambda c: c.visibility(np.array([0]), one_seq(1, 4), 8),
     "seq_mask (1, 4) should have shapes (n_tokens,) and (n_tokens, 16)"),
    (lambda c: c.apply(np.array([3]), np.array([0]), one_seq(1, 16)), "cell 3 is not free (it holds position 3)"),
    (lambda c: c.apply(np.array([32]), np.array([0]), one_seq(1, 16)), "cell 32 is outside [0, 32)"),
    (lambda c: c.apply(np.array([9, 9]), np.array([0, 1]), one_seq(2, 16)), "name a cell twice"),
    (lambda c: c.apply(np.array([9, 10]), np.array([0]), one_seq(1, 16)), "cells has shape (2,), expected (1,)"),
    (lambda c: c.apply(np.array([9]), np.array([-2]), one_seq(1, 16)), "position -2 is below 0"),
    (lambda c: c.apply(np.array([9]), np.array([0]), np.zeros((1, 16), bool)), "token 0 belongs to no sequence"),
    (lambda c: c.move(9, 10), "cannot move cell 9: it is empty"),
    (lambda c: c.move(1, 2), "cannot move cell 1 to cell 2: it holds position 2"),
    (lambda c: c.move(1, 32), "cell 32 is outside [0, 32)"),
])
def test_errors_name_the_value_and_the_limit(call, message):
    cells = filled(32, n_seq_max=16, n_tokens=8)
    before = state(cells)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(cells)
    assert_same_state(state(cells), before)


@pytest.mark.parametrize("n_cells, n_seq_max, message", [
    (0, 4, "n_cells must be >= 1, got 0"),
    (8, -1, "n_seq_max must be >= 1, got -1"),
])
def test_constructor_rejects_non_positive_sizes(n_cells, n_seq_max, message):
    with pytest.raises(ValueError, match=message):
        Cells(n_cells, n_seq_max)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40))
def test_compaction_moves_close_every_hole_in_order(layout):
    cells = Cells(len(layout), 1)
    used = np.flatnonzero(layout)
    if used.size:
        cells.apply(used, used, one_seq(used.size, 1))
    for src, dst in cells.compaction_moves():
        cells.move(src, dst)
    assert cells.pos.tolist() == used.tolist() + [-1] * (len(layout) - used.size)


def test_share_and_unshare_lend_cells_without_copying():
    cells = Cells(8, 3)
    cells.apply(np.array([0, 1, 2]), np.array([0, 1, 2]), np.eye(3, dtype=bool)[[0, 0, 0]])
    cells.share(np.array([0, 1]), 2)
    assert (cells.seq_pos_min(2), cells.seq_pos_max(2)) == (0, 1)
    assert cells.unshare(np.array([0, 1]), 0) == 0  # sequence 2 still uses them
    assert cells.n_used == 3 and cells.seq_pos_max(0) == 2
    assert cells.unshare(np.array([0, 1]), 2) == 2
    assert cells.n_used == 1
    with pytest.raises(ValueError, match="cannot share cell 5: it is empty"):
        cells.share(np.array([5]), 1)
