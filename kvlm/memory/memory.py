"""Many sequences in one pool of cells: the bookkeeping (Cells) and the tensors (KVStore) together.

The unified KV cache is one such pool over every layer; the iSWA kind (iswa.py) keeps two."""
from __future__ import annotations

import numpy as np
import torch

from kvlm.core.family import ATTENTION
from kvlm.core.config import ModelConfig
from kvlm.memory.cells import Cells
from kvlm.memory.kv_store import KVStore
from kvlm.memory.seq_state import load_sequence, save_sequence
from kvlm.memory.view import AttentionGroup, KVView, LayerViews, TokenCells
from kvlm.core.rope import apply_rope
from kvlm.core.rope import Rope


# Lone decode tokens each gather their own rows; beyond this many rows in all, they are grouped one by one.
GATHER_MAX_ROWS = 1 << 16
PER_TOKEN_ROWS_MAX = 33  # a sequence's tokens that still read their rows each as a decode token (1 + 32 guesses)


def _additive(visible: np.ndarray) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(torch.from_numpy(~visible), float("-inf"))


def attention_groups(visible: np.ndarray, seq_mask: np.ndarray, cell_pos: np.ndarray) -> list[AttentionGroup]:
    """Tokens attend over only the cells they see, in position order: never over other sequences' cells.

    So a sequence's rows, their order and the shapes its attention runs with do not depend on what else is
    in the cache (a rounding cache would turn such float32 noise into whole-ulp flips of the stored K/V).
    The tokens of the same sequences form one group and gather its cells once; lone tokens (decode) and short
    runs of a sequence's tokens (guesses being verified) are batched into one group with per-token rows, padded
    to the longest: each such token then reads what it would read decoded alone, in the same order, through the
    same kernel, so verifying guesses computes the very logits decoding them one by one would.
    """
    group_of, sizes = _same_sequences(seq_mask)
    lone = np.flatnonzero(sizes[group_of] <= PER_TOKEN_ROWS_MAX)
    groups = []
    if lone.size > 1:
        seen = _nonzero_sparse(visible if len(lone) == len(visible) else visible[lone])  # decode: no copy
        counts = np.bincount(seen[0], minlength=len(lone))
    if lone.size > 1 and lone.size * int(counts.max()) <= GATHER_MAX_ROWS:
        groups.append(_per_token_rows_group(seen, counts, cell_pos, lone))
    else:
        groups += [_shared_rows_group(visible, cell_pos, np.array([token])) for token in lone]
    for group in np.flatnonzero(sizes > PER_TOKEN_ROWS_MAX):
        groups.append(_shared_rows_group(visible, cell_pos, np.flatnonzero(group_of == group)))
    return groups


def _same_sequences(seq_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token, the index of its set of sequences; and how many tokens have each set."""
    rows = np.packbits(seq_mask, axis=1)
    keys = rows.view(np.dtype((np.void, rows.shape[1]))).ravel()  # far faster than np.unique(axis=0)
    _, group_of, sizes = np.unique(keys, return_inverse=True, return_counts=True)
    return group_of.reshape(-1), sizes


def _nonzero_sparse(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.nonzero of a C-contiguous bool matrix, row by row, reading 8 entries at a time and looking inside only
    the groups with one set: a decode step's tokens each see ~1% of the cells, where np.nonzero takes 4x as long."""
    flat = matrix.reshape(-1)
    whole = flat.size - flat.size % 8
    hit = np.flatnonzero(flat[:whole].view(np.uint64))
    index = (hit[:, None] * 8 + np.arange(8)).reshape(-1)
    index = np.concatenate((index[flat[index]], whole + np.flatnonzero(flat[whole:])))
    return np.divmod(index, matrix.shape[1])


def _per_token_rows_group(seen: tuple[np.ndarray, np.ndarray], counts: np.ndarray, cell_pos: np.ndarray,
                          tokens: np.ndarray) -> AttentionGroup:
    """Per token, its visible cells by position (padded to the most any token sees) and the mask hiding the
    padding; `seen`: (row, cell) of what `tokens` see, by row then cell (np.nonzero's order), and `counts` per row."""
    token, cell = seen
    positions = cell_pos[cell]
    if np.any((np.diff(positions) <= 0) & (np.diff(token) == 0)):  # cells out of position order: sort them
        order = np.lexsort((positions, token))  # by token, then by position: sorts only the visible cells
        token, cell = token[order], cell[order]
    longest = int(counts.max())
    column = np.arange(len(token)) - np.repeat(np.cumsum(counts) - counts, counts)
    index = np.zeros((len(tokens), longest), dtype=np.int64)  # padding reads cell 0, masked out
    real = np.zeros((len(tokens), longest), dtype=bool)
    index[token, column], real[token, column] = cell, True
    return AttentionGroup(torch.from_numpy(tokens), torch.from_numpy(index), _additive(real), torch.from_numpy(counts))


def _shared_rows_group(visible: np.ndarray, cell_pos: np.ndarray, tokens: np.ndarray) -> AttentionGroup:
    """The tokens of one set of sequences over the cells any of them sees, gathered once in position order; each
    token's own cells are then one run of them (its positions from the window's start up to its own)."""
    seen = visible if len(tokens) == len(visible) else visible[tokens]  # a prompt chunk alone: no copy
    cells = np.flatnonzero(seen.any(axis=0))
    cells = cells[np.argsort(cell_pos[cells], kind="stable")]
    if len(cells) != seen.shape[1] or np.any(cells != np.arange(len(cells))):
        seen = seen[:, cells]
    if seen.all():
        return AttentionGroup(torch.from_numpy(tokens), torch.from_numpy(cells), None)
    starts, lengths = seen.argmax(axis=1), seen.sum(axis=1)
    ends = seen.shape[1] - seen[:, ::-1].argmax(axis=1)
    if np.any(ends - starts != lengths):  # a token whose cells are not one run of positions: rows of its own
        seen = np.nonzero(visible[tokens])
        return _per_token_rows_group(seen, np.bincount(seen[0], minlength=len(tokens)), cell_pos, tokens)
    return AttentionGroup(torch.from_numpy(tokens), torch.from_numpy(cells), _additive(seen),
                          torch.from_numpy(lengths), torch.from_numpy(starts))


class LendsCells:
    """How a prefix cache lends cells: a sequence added to, or removed from, cells it names pool by pool."""

    def share(self, block: list[np.ndarray], seq_id: int) -> None:
        for pool, cells in zip(self.pools, block):
            pool.cells.share(cells, seq_id)

    def unshare(self, block: list[np.ndarray], seq_id: int) -> None:
        for pool, cells in zip(self.pools, block):
            pool.cells.unshare(cells, seq_id)


class KVMemory(LendsCells):
    """llama.cpp's unified KV cache: sequence operations on cells, K/V rows indexed by cell.

    Sequence operations change only the bookkeeping; a position change (seq_add, seq_div) leaves a
    pending shift that `apply_shifts` turns into a rotation of the cached K before the next compute.
    The same class is a pool of the iSWA kind: it then holds a subset of the layers and, with `kept_window`,
    frees the cells that fall out of every sequence's sliding window as decoding goes on.
    """

    kind = "unified"

    def __init__(self, config: ModelConfig, n_cells: int, n_seq_max: int, kv_dtype: str, layer_ropes: list[Rope],
                 layer_windows: list[int] | None = None, kept_window: int = 0, name: str = "kv",
                 kind: str = ATTENTION, readers: list[int] | None = None, spare_cell: bool = False) -> None:
        """`layer_ropes`: the RoPE of each layer stored here, which the K-shift re-applies; `layer_windows`: each
        one's sliding window (0: full attention); `kept_window`: 0 keeps every cell, else a sequence keeps only
        the cells at positions p with next - p < kept_window, `next` being its last position + 1; `kind`: the
        layers' kind, whose geometry the rows have; `readers[i]`: the layer stored here that model layer i reads
        (when some layers read others' K/V), else layer i is layer i here; `spare_cell`: the store keeps one more
        row for a CUDA graph's padded lanes (see KVStore)."""
        self.cells = Cells(n_cells, n_seq_max)
        self.store = KVStore(config, n_cells, kv_dtype, n_layer=len(layer_ropes), kind=kind, spare_cell=spare_cell)
        self.readers = readers
        self.layer_ropes = layer_ropes
        self.layer_windows = layer_windows or [0] * len(layer_ropes)
        self.kept_window = kept_window
        self.name = name
        self.config = config
        self.kv_dtype = kv_dtype
        self.retained = np.zeros(n_seq_max, dtype=bool)
        self._undo: tuple[Cells, list] | None = None

    # --- the llama.cpp memory API ---
    @property
    def pools(self) -> tuple[KVMemory, ...]:
        return (self,)

    @property
    def window(self) -> int:
        """The sliding window of every layer here; 0 if some layer attends over everything."""
        return min(self.layer_windows) if all(self.layer_windows) else 0

    @property
    def n_cells(self) -> int:
        return self.cells.n_cells

    @property
    def n_used(self) -> int:
        return self.cells.n_used

    @property
    def n_free(self) -> int:
        """Free cells, counting those the next micro-batch frees from sliding windows."""
        free = self.n_cells - self.n_used
        return free + self.cells.n_freed_by(self._stale()) if self.kept_window else free

    @property
    def kv_bytes(self) -> int:
        return self.store.kv_bytes

    def cells_short(self, n_tokens: int) -> int:
        """How many cells are missing for n_tokens more tokens (0: they fit)."""
        return max(0, n_tokens - self.n_free)

    def retain(self, seq_id: int) -> None:
        """seq_id holds cells for others (the engine's prefix cache): they are never pruned from its window."""
        self.retained[self.cells._seq(seq_id)] = True

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return self.cells.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.cells.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.cells.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.cells.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.cells.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.cells.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.cells.seq_pos_max(seq_id)

    def checkpoint(self, seq_id: int) -> None:
        """Nothing to keep before guessed tokens: removing their cells (seq_rm of the tail) takes them back."""

    def restore(self, checkpoint: None) -> None:
        """Nothing to put back (see checkpoint)."""

    def clear(self) -> None:
        self.cells.clear()

    def compact(self) -> None:
        """Move used cells (metadata and K/V rows) down to close every hole; results do not change."""
        self.apply_shifts()
        for src, dst in self.cells.compaction_moves():
            self.store.copy_rows(torch.tensor([src]), torch.tensor([dst]))
            self.cells.move(src, dst)

    def state_seq_save(self, seq_id: int) -> bytes:
        self.apply_shifts()
        return save_sequence(self.pools, seq_id)

    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None:
        """Restore a saved sequence into `dest_seq_id`, which must be empty; on any error nothing changes."""
        load_sequence(self.pools, data, dest_seq_id)

    # --- what Context.decode needs: plan, begin, place each micro-batch, then commit or roll back ---
    def apply_shifts(self) -> None:
        """Rotate cached K by the pending position deltas: RoPE(p + d) = R(d) RoPE(p)."""
        if not self.cells.has_shift:
            return
        cells, deltas = self.cells.take_shifts()
        device = self.store.device
        rows = torch.from_numpy(cells).to(device)
        rotations = {id(rope): tuple(t.to(device) for t in rope.shift_cos_sin(torch.from_numpy(deltas)))
                     for rope in self.layer_ropes}
        for layer, rope in enumerate(self.layer_ropes):
            keys = self.store.k.read(layer, self.n_cells)[rows].float()
            self.store.k.write(layer, rows, apply_rope(keys, *rotations[id(rope)]))

    def split(self, batch, n_ubatch: int) -> list:
        return batch.split(n_ubatch)

    def plan(self, ubatches) -> list[np.ndarray] | None:
        """Cells for every micro-batch, found as a dry run on a copy; None if any does not fit."""
        trial = self.cells.copy()
        slots = []
        for ubatch in ubatches:
            self._prune(trial)
            slot = trial.find_slot(len(ubatch.tokens))
            if slot is None:
                return None
            trial.apply(slot, ubatch.pos, ubatch.seq_mask)
            slots.append(slot)
        return slots

    def begin(self) -> None:
        """Start a batch: what `roll_back` returns to."""
        self._undo = (self.cells.copy(), [])

    def place(self, ubatch, slot: np.ndarray) -> KVView | LayerViews:
        """Claim the planned cells for a micro-batch and describe what its forward pass may touch: one view, or
        one per layer when sliding-window layers see fewer cells than full ones."""
        self._prune(self.cells)
        self._keep_rows_for_undo(slot)
        self.cells.apply(slot, ubatch.pos, ubatch.seq_mask)
        rows = torch.from_numpy(slot)
        windows = sorted(set(self.layer_windows))
        if len(windows) == 1 and self.readers is None:
            return self._view(ubatch, rows, windows[0])
        views = {window: self._view(ubatch, rows, window) for window in windows}
        stored = range(len(self.layer_windows)) if self.readers is None else self.readers
        return LayerViews([(views[self.layer_windows[layer]], layer) for layer in stored])

    def commit(self) -> None:
        self._undo = None

    def roll_back(self) -> None:
        """Back to `begin`: the cells as they were (restored in place: the prefix cache holds this object) and
        the K/V rows of cells this batch took over from sliding windows."""
        snapshot, kept_rows = self._undo
        self.cells.restore(snapshot)
        for rows, parts in reversed(kept_rows):
            for plane, plane_parts in zip((self.store.k, self.store.v), parts):
                plane.scatter(rows, plane_parts)
        self._undo = None

    def _stale(self, cells: Cells | None = None) -> np.ndarray:
        return (self.cells if cells is None else cells).stale(self.kept_window, self.retained)

    def _prune(self, cells: Cells) -> None:
        if self.kept_window:
            cells.prune(self._stale(cells))

    def _keep_rows_for_undo(self, slot: np.ndarray) -> None:
        """A cell pruned during this batch still held live rows before it: keep them in case of a roll back."""
        snapshot, kept_rows = self._undo
        taken = slot[snapshot.pos[slot] >= 0]
        if taken.size:
            rows = torch.from_numpy(taken)
            kept_rows.append((rows, [plane.gather(rows) for plane in (self.store.k, self.store.v)]))

    def _view(self, ubatch, rows: torch.Tensor, window: int) -> KVView:
        n_kv = self.cells.used_max
        visible = self.cells.visibility(ubatch.pos, ubatch.seq_mask, n_kv, window)
        groups = attention_groups(visible, ubatch.seq_mask, self.cells.pos[:n_kv])
        ordered = len(groups) == 1 and torch.equal(groups[0].index, torch.arange(n_kv))  # no gather needed
        device = self.store.device
        if device.type == "cpu":
            return KVView(self.store, rows, n_kv, groups, ordered)
        rows, cells = TokenCells.of(groups, len(rows)).to(device, rows)  # what the step reads: one copy
        return KVView(self.store, rows, n_kv, groups, ordered, cells)
