"""Bookkeeping of a KV cell pool shared by several sequences (llama.cpp's kv-cells, in NumPy).

Cell i holds the K/V of one token at position pos[i], used by the sequences seqs[i]. The tensors
live in a KV store indexed by cell; this class only decides which cell holds what. A cell is empty
iff no sequence uses it, and then pos is -1 and shift is 0.

Differences from llama.cpp: bad arguments raise ValueError instead of asserting; seq_div records
shift = new - old (llama.cpp's pos_div records old - new); has_shift is derived from the shifts,
so moves that cancel out need no K-shift.
"""
from __future__ import annotations

import operator

import numpy as np

INFINITE_POS = np.iinfo(np.int64).max


class Cells:
    """Every operation is a vectorised NumPy pass over the cells, and copy() is three array copies.

    seq_pos_min/max scan the cells instead of keeping per-sequence position counts: for 8192 cells
    and 16 sequences a scan costs ~10 us, less than min() over a dict of 1600 positions (~20 us),
    and it keeps apply/seq_*/move free of per-cell Python updates and copy() cheap (~7 us).
    """

    def __init__(self, n_cells: int, n_seq_max: int) -> None:
        for name, value in (("n_cells", n_cells), ("n_seq_max", n_seq_max)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.n_cells, self.n_seq_max = int(n_cells), int(n_seq_max)
        self.pos = np.full(self.n_cells, -1, dtype=np.int64)
        # members[s, i]: sequence s uses cell i. Stored sequence-major, so a sequence's cells (what the position
        # scans and each token's visibility read) are contiguous; `seqs` is the cell-major view of the same bits.
        self.members = np.zeros((self.n_seq_max, self.n_cells), dtype=bool)
        self.shift = np.zeros(self.n_cells, dtype=np.int64)
        self.head = 0  # where find_slot starts looking: just after the last placed token

    @property
    def seqs(self) -> np.ndarray:
        """bool [n_cells, n_seq_max]: cell i is used by sequence s (a view of `members`: writes go through)."""
        return self.members.T

    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.pos >= 0))

    @property
    def used_max(self) -> int:
        used = np.flatnonzero(self.pos >= 0)
        return int(used[-1]) + 1 if used.size else 0

    @property
    def has_shift(self) -> bool:
        return bool(self.shift.any())

    def copy(self) -> Cells:
        other = Cells.__new__(Cells)
        other.__dict__.update(self.__dict__)
        other.pos, other.members, other.shift = self.pos.copy(), self.members.copy(), self.shift.copy()
        return other

    def restore(self, snapshot: Cells) -> None:
        """Take back the state of a `copy()`, in place: whoever holds this object (the prefix cache) sees it.

        The snapshot's arrays are taken over, not copied: it must not be used afterwards."""
        self.__dict__.update(snapshot.__dict__)

    def seq_pos_min(self, seq_id: int) -> int:
        positions = self.pos[self.members[self._seq(seq_id)]]
        return int(positions.min()) if positions.size else -1

    def seq_pos_max(self, seq_id: int) -> int:
        positions = self.pos[self.members[self._seq(seq_id)]]
        return int(positions.max()) if positions.size else -1

    def seq_cells(self, seq_id: int) -> np.ndarray:
        """Indices of the cells of a sequence, sorted by position."""
        cells = np.flatnonzero(self.members[self._seq(seq_id)])
        return cells[np.argsort(self.pos[cells], kind="stable")]

    def find_slot(self, n_tokens: int) -> np.ndarray | None:
        """n_tokens free cells, not necessarily contiguous, searched from head with wrap-around.

        As in llama.cpp, the search restarts at cell 0 when head is far beyond the number of used
        cells: filling the holes low in the pool keeps used_max, hence the attention span, small.
        """
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        free = np.flatnonzero(self.pos < 0)
        if free.size < n_tokens:
            return None
        start = 0 if self.head > self.n_used + 2 * n_tokens else self.head
        return np.roll(free, -int(np.searchsorted(free, start)))[:n_tokens]

    def apply(self, cells: np.ndarray, positions: np.ndarray, seq_mask: np.ndarray) -> None:
        """Place token i in free cell cells[i] at positions[i], used by the sequences seq_mask[i]."""
        positions, seq_mask = self._check_batch(positions, seq_mask)
        cells = self._check_cells(cells, len(positions))
        self.pos[cells] = positions
        self.seqs[cells] = seq_mask
        self.head = (int(cells[-1]) + 1) % self.n_cells

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove seq_id (-1: every sequence) from the cells with p0 <= pos < p1; p0 < 0 is 0, p1 < 0 is infinity."""
        seq_id = self._seq(seq_id, lowest=-1)
        hit = np.flatnonzero(self._in_range(p0, p1))
        if seq_id >= 0:
            hit = hit[self.seqs[hit, seq_id]]
            self.seqs[hit, seq_id] = False
            hit = hit[~self.seqs[hit].any(axis=1)]  # only the hit rows: any() over all cells costs ~0.2 ms
        self._free(hit)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Let dst share the cells of src in [p0, p1): nothing is copied, the cells gain a sequence."""
        src, dst = self._seq(src), self._seq(dst)
        self.seqs[self._in_range(p0, p1) & self.seqs[:, src], dst] = True

    def share(self, cells: np.ndarray, seq_id: int) -> None:
        """Add seq_id to some used cells: how a prefix cache lends its cells to a request."""
        cells, seq_id = np.asarray(cells, dtype=np.int64), self._seq(seq_id)
        empty = cells[self.pos[cells] < 0]
        if empty.size:
            raise ValueError(f"cannot share cell {empty[0]}: it is empty")
        self.seqs[cells, seq_id] = True

    def unshare(self, cells: np.ndarray, seq_id: int) -> int:
        """Remove seq_id from some cells; returns how many cells that left empty (and freed)."""
        cells, seq_id = np.unique(np.asarray(cells, dtype=np.int64)), self._seq(seq_id)
        self.seqs[cells, seq_id] = False
        freed = cells[(self.pos[cells] >= 0) & ~self.seqs[cells].any(axis=1)]
        self._free(freed)
        return int(freed.size)

    def seq_keep(self, seq_id: int) -> None:
        """Drop every other sequence; cells not used by seq_id become empty."""
        keep = self.seqs[:, self._seq(seq_id)].copy()
        gone = (self.pos >= 0) & ~keep
        self.seqs[keep] = False
        self.seqs[keep, seq_id] = True
        self._free(np.flatnonzero(gone))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move the cells of seq_id in [p0, p1) by delta; cells pushed below position 0 are freed.

        A cell has one position, so every other sequence sharing a moved cell moves with it (as in
        llama.cpp): shift a shared prefix only together with all the sequences that use it.
        """
        hit = self._in_range(p0, p1) & self.seqs[:, self._seq(seq_id)]
        if delta == 0:
            return
        self.pos[hit] += delta
        self.shift[hit] += delta
        self._free(np.flatnonzero(hit & (self.pos < 0)))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide the positions of seq_id's cells in [p0, p1) by d (shared cells move too, see seq_add)."""
        if d < 1:
            raise ValueError(f"divisor d must be >= 1, got {d}")
        hit = self._in_range(p0, p1) & self.seqs[:, self._seq(seq_id)]
        new = self.pos[hit] // d
        self.shift[hit] += new - self.pos[hit]
        self.pos[hit] = new

    def stale(self, window: int, retained: np.ndarray) -> np.ndarray:
        """bool [n_cells, n_seq_max]: cell i holds sequence s at a position that s's next token (at its last
        position + 1) no longer sees through a sliding `window`; never for the `retained` sequences."""
        held = self.seqs & ~retained[None, :]
        pos_max = np.where(held, self.pos[:, None], -1).max(axis=0, initial=-1)
        return held & (self.pos[:, None] <= pos_max[None, :] + 1 - window)

    def n_freed_by(self, stale: np.ndarray) -> int:
        """How many cells pruning `stale` would empty."""
        return int(np.count_nonzero((self.pos >= 0) & ~(self.seqs & ~stale).any(axis=1)))

    def prune(self, stale: np.ndarray) -> int:
        """Remove the stale (cell, sequence) pairs; cells left with no sequence are freed. Returns how many."""
        used = self.pos >= 0
        self.members &= ~stale.T
        freed = np.flatnonzero(used & ~self.members.any(axis=0))
        self._free(freed)
        return int(freed.size)

    def seq_positions(self, seq_id: int) -> np.ndarray:
        return self.pos[self.members[self._seq(seq_id)]]

    def seq_cells_in(self, seq_id: int, p0: int, p1: int) -> np.ndarray:
        """The cells of a sequence at positions p0 <= pos < p1, sorted by position."""
        cells = self.seq_cells(seq_id)
        return cells[(self.pos[cells] >= p0) & (self.pos[cells] < p1)]

    def take_shifts(self) -> tuple[np.ndarray, np.ndarray]:
        """(cells whose K must be re-rotated, by how many positions); the shifts are reset to 0."""
        cells = np.flatnonzero(self.shift)
        deltas = self.shift[cells]
        self.shift[cells] = 0
        return cells, deltas

    def clear(self) -> None:
        self.pos.fill(-1)
        self.seqs.fill(False)
        self.shift.fill(0)
        self.head = 0

    def visibility(self, positions: np.ndarray, seq_mask: np.ndarray, n_kv: int, window: int = 0) -> np.ndarray:
        """bool [n_tokens, n_kv]: token i sees cell j iff they share a sequence and pos[j] <= positions[i], and
        with a sliding `window`, positions[i] - pos[j] < window (the token's own position counts as one).

        Empty cells have no sequence, so sharing one also means the cell is used. When every token has one
        sequence (every engine step) the test is a gather of that sequence's column; no BLAS product (whose
        threads spin after it and take a core from the compute threads).
        """
        if not 0 <= n_kv <= self.n_cells:
            raise ValueError(f"n_kv {n_kv} is outside [0, {self.n_cells}]")
        positions, seq_mask = self._check_batch(positions, seq_mask)
        if np.all(seq_mask.sum(axis=1) == 1):
            shared = self.members[seq_mask.argmax(axis=1), :n_kv]
        else:
            shared = np.zeros((len(positions), n_kv), dtype=bool)
            for seq in np.flatnonzero(seq_mask.any(axis=0)):
                shared |= seq_mask[:, seq, None] & self.seqs[None, :n_kv, seq]
        visible = shared & (self.pos[None, :n_kv] <= positions[:, None])
        if window:
            visible &= positions[:, None] - self.pos[None, :n_kv] < window
        return visible

    def compaction_moves(self) -> list[tuple[int, int]]:
        """(src, dst) moves that, applied in order, pack the used cells into [0, n_used) in their order.

        The k-th used cell goes to cell k; when it moves, cells [0, k) hold its predecessors, so k is free.
        """
        used = np.flatnonzero(self.pos >= 0)
        moved = used != np.arange(used.size)
        return [(int(src), int(dst)) for src, dst in zip(used[moved], np.flatnonzero(moved))]

    def move(self, src: int, dst: int) -> None:
        """Move one cell's metadata to an empty cell; the caller moves its K/V rows."""
        src, dst = self._cell(src), self._cell(dst)
        if self.pos[src] < 0:
            raise ValueError(f"cannot move cell {src}: it is empty")
        if self.pos[dst] >= 0:
            raise ValueError(f"cannot move cell {src} to cell {dst}: it holds position {self.pos[dst]}")
        for array in (self.pos, self.seqs, self.shift):  # (seqs: a view, written through)
            array[dst] = array[src]
        self._free(np.array([src]))

    def _free(self, freed: np.ndarray) -> None:
        """Empty these cells (ascending indices); find_slot then starts at the first if it is before head."""
        if freed.size:
            self.pos[freed], self.shift[freed], self.seqs[freed] = -1, 0, False
            self.head = min(self.head, int(freed[0]))

    def _in_range(self, p0: int, p1: int) -> np.ndarray:
        p0 = max(int(p0), 0)
        p1 = INFINITE_POS if p1 < 0 else int(p1)
        return (self.pos >= p0) & (self.pos < p1)

    def _seq(self, seq_id: int, lowest: int = 0) -> int:
        if not lowest <= operator.index(seq_id) < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} is outside [{lowest}, {self.n_seq_max})")
        return int(seq_id)

    def _cell(self, cell: int) -> int:
        if not 0 <= operator.index(cell) < self.n_cells:
            raise ValueError(f"cell {cell} is outside [0, {self.n_cells})")
        return int(cell)

    def _check_batch(self, positions, seq_mask) -> tuple[np.ndarray, np.ndarray]:
        positions, seq_mask = np.asarray(positions, dtype=np.int64), np.asarray(seq_mask, dtype=bool)
        n = len(positions) if positions.ndim == 1 else -1
        if seq_mask.shape != (n, self.n_seq_max):
            raise ValueError(
                f"positions {positions.shape} and seq_mask {seq_mask.shape} should have shapes "
                f"(n_tokens,) and (n_tokens, {self.n_seq_max})"
            )
        if n and positions.min() < 0:
            raise ValueError(f"position {positions.min()} is below 0")
        lonely = np.flatnonzero(~seq_mask.any(axis=1))
        if lonely.size:
            raise ValueError(f"token {lonely[0]} belongs to no sequence (its seq_mask row has no True)")
        return positions, seq_mask

    def _check_cells(self, cells, n_tokens: int) -> np.ndarray:
        cells = np.asarray(cells, dtype=np.int64)
        if cells.shape != (n_tokens,) or n_tokens == 0:
            raise ValueError(f"cells has shape {cells.shape}, expected ({n_tokens},) with n_tokens >= 1")
        outside = cells[(cells < 0) | (cells >= self.n_cells)]
        if outside.size:
            raise ValueError(f"cell {outside[0]} is outside [0, {self.n_cells})")
        if np.unique(cells).size != n_tokens:
            raise ValueError(f"cells {cells.tolist()} name a cell twice")
        taken = cells[self.pos[cells] >= 0]
        if taken.size:
            raise ValueError(f"cell {taken[0]} is not free (it holds position {self.pos[taken[0]]})")
        return cells
