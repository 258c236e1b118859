"""llama.cpp's iSWA cache: full-attention layers in one pool of n_ctx cells, sliding-window layers in a second,
small pool that frees every cell once it has left the window of each sequence using it.

Both pools see the same micro-batches and sequence operations. The sliding pool holds about
window x sequences + one micro-batch of cells, so at long context most of the KV memory is saved. What that
costs: a sequence can no longer go back beyond its window. An operation that would need freed cells (seq_rm
into the past, seq_cp of an old prefix, a shift that brings freed positions back into view) is refused and
changes nothing; seq_rm answers False, the others raise CacheError. `seq_pos_min` says how far back a sequence
is still whole, as in llama.cpp.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvlm.core.errors import CacheError
from kvlm.core.family import SLIDING
from kvlm.core.config import ModelConfig
from kvlm.memory.memory import KVMemory, LendsCells
from kvlm.memory.seq_state import load_sequence, save_sequence
from kvlm.memory.view import LayerViews
from kvlm.core.rope import Rope

if TYPE_CHECKING:
    from kvlm.memory.layout import PoolLayout


def sliding_pool_cells(n_ctx: int, window: int, n_seq_max: int, n_ubatch: int, keep_extra: int = 0) -> int:
    """llama.cpp's size for the sliding pool: a window per sequence and one micro-batch (at most n_ctx)."""
    return min(n_ctx, (window + keep_extra) * n_seq_max + n_ubatch)


class ISWAMemory(LendsCells):
    kind = "iswa"

    def __init__(self, config: ModelConfig, full: PoolLayout, sliding: PoolLayout, n_seq_max: int, n_ubatch: int,
                 kv_dtype: str, layer_ropes: list[Rope], keep_extra: int = 0, swa_full: bool = False,
                 spare_cell: bool = False) -> None:
        """The two pools kvlm.memory.layout decided (their layers, those holding their own K/V, and cells);
        `keep_extra`: positions each sequence keeps beyond its window (the engine keeps a prefix-cache block's
        worth, so a cached prefix can end anywhere); `swa_full`: the sliding pool keeps every cell (for a model
        whose two kinds of layers have K/V rows of different sizes, which one pool cannot hold). A layer reading
        another's K/V (see ModelConfig.kv_source) goes through that one's rows. `spare_cell`: see KVStore."""
        window = config.sliding_window
        self.full = KVMemory(config, full.n_cells, n_seq_max, kv_dtype, [layer_ropes[i] for i in full.layers],
                             name="full", spare_cell=spare_cell)
        self.sliding = KVMemory(config, sliding.n_cells, n_seq_max, kv_dtype, [layer_ropes[i] for i in sliding.layers],
                                layer_windows=[window] * len(sliding.layers),
                                kept_window=0 if swa_full else window + keep_extra, name="sliding", kind=SLIDING,
                                spare_cell=spare_cell)
        self.window = window
        self.n_ubatch = n_ubatch
        home = {i: (0, full.layers.index(i)) if i in full.layers else (1, sliding.layers.index(i))
                for i in full.layers + sliding.layers}
        self.layer_home = [home[config.kv_source(i)] for i in range(config.n_layer)]

    @property
    def pools(self) -> tuple[KVMemory, KVMemory]:
        return self.full, self.sliding

    @property
    def n_cells(self) -> int:
        return self.full.n_cells

    @property
    def n_used(self) -> int:
        return self.full.n_used

    @property
    def n_free(self) -> int:
        return self.full.n_free

    @property
    def kv_bytes(self) -> int:
        return self.full.kv_bytes + self.sliding.kv_bytes

    def cells_short(self, n_tokens: int) -> int:
        """Cells missing for n_tokens more tokens; the sliding pool needs room for one micro-batch of them."""
        return max(self.full.cells_short(n_tokens), self.sliding.cells_short(min(n_tokens, self.n_ubatch)))

    def retain(self, seq_id: int) -> None:
        for pool in self.pools:
            pool.retain(seq_id)

    # --- sequence operations: on both pools, refused when a window would lose cells ---
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        try:
            self._on_both(lambda pool: pool.seq_rm(seq_id, p0, p1), affected=seq_id)
        except CacheError:
            return False
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._on_both(lambda pool: pool.seq_cp(src, dst, p0, p1), affected=dst)

    def seq_keep(self, seq_id: int) -> None:
        self._on_both(lambda pool: pool.seq_keep(seq_id), affected=seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self._on_both(lambda pool: pool.seq_add(seq_id, p0, p1, delta), affected=seq_id)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self._on_both(lambda pool: pool.seq_div(seq_id, p0, p1, d), affected=seq_id)

    def seq_pos_min(self, seq_id: int) -> int:
        """The first position from which the sequence is whole in both pools (the sliding pool's, as llama.cpp)."""
        return max(pool.seq_pos_min(seq_id) for pool in self.pools)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.full.seq_pos_max(seq_id)

    checkpoint, restore = KVMemory.checkpoint, KVMemory.restore  # guessed tokens go by seq_rm, as in one pool

    def clear(self) -> None:
        for pool in self.pools:
            pool.clear()

    def compact(self) -> None:
        for pool in self.pools:
            pool.compact()

    def state_seq_save(self, seq_id: int) -> bytes:
        self.apply_shifts()
        return save_sequence(self.pools, seq_id)

    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None:
        load_sequence(self.pools, data, dest_seq_id)

    # --- what Context.decode needs ---
    def apply_shifts(self) -> None:
        for pool in self.pools:
            pool.apply_shifts()

    def split(self, batch, n_ubatch: int) -> list:
        return batch.split(n_ubatch)

    def plan(self, ubatches) -> list[tuple[np.ndarray, np.ndarray]] | None:
        full, sliding = self.full.plan(ubatches), self.sliding.plan(ubatches)
        return None if full is None or sliding is None else list(zip(full, sliding))

    def begin(self) -> None:
        for pool in self.pools:
            pool.begin()

    def place(self, ubatch, slots: tuple[np.ndarray, np.ndarray]) -> LayerViews:
        views = [pool.place(ubatch, slot) for pool, slot in zip(self.pools, slots)]
        return LayerViews([(views[pool], local) for pool, local in self.layer_home])

    def commit(self) -> None:
        for pool in self.pools:
            pool.commit()

    def roll_back(self) -> None:
        for pool in self.pools:
            pool.roll_back()

    def _on_both(self, operation, affected: int) -> None:
        """Run a sequence operation on both pools; if it leaves a sequence's window short of cells the sliding
        pool has freed, undo it and raise."""
        before = [pool.cells.copy() for pool in self.pools]
        for pool in self.pools:
            operation(pool)
        seqs = range(self.full.cells.n_seq_max) if affected < 0 else [affected]
        broken = next((s for s in seqs if self._window_lost(s) is not None), None)
        if broken is None:
            return
        first_missing = self._window_lost(broken)
        for pool, snapshot in zip(self.pools, before):
            pool.cells.restore(snapshot)
        raise CacheError(f"sequence {broken} would need position {first_missing} in its sliding window "
                         f"({self.window}), but that cell was freed (the sequence is whole from position "
                         f"{self.seq_pos_min(broken)}); recompute instead, or keep every cell with swa_full")

    def _window_lost(self, seq_id: int) -> int | None:
        """The first position the sequence's next token must see that the sliding pool no longer holds."""
        if self.full.retained[seq_id]:
            return None
        positions = self.full.cells.seq_positions(seq_id)
        if positions.size == 0:
            return None
        seen_next = positions[positions.max() + 1 - positions < self.window]
        missing = np.setdiff1d(seen_next, self.sliding.cells.seq_positions(seq_id))
        return int(missing[0]) if missing.size else None
