"""llama.cpp's hybrid memory: a KV cache for the attention layers and recurrent state slots for the others (short
convolutions, delta rules), planned, committed and rolled back together.

The recurrent part sets the limits: a sequence is kept or removed whole, never shifted; micro-batches give each
sequence the same number of tokens.
"""
from __future__ import annotations

import numpy as np

from kvlm.core.config import ModelConfig
from kvlm.memory.memory import KVMemory, LendsCells
from kvlm.memory.recurrent import RecurrentMemory
from kvlm.memory.seq_state import load_sequence, save_sequence
from kvlm.memory.view import LayerViews
from kvlm.core.rope import Rope


class HybridMemory(LendsCells):
    kind = "hybrid"

    def __init__(self, config: ModelConfig, n_ctx: int, n_seq_max: int, kv_dtype: str, layer_ropes: list[Rope],
                 state_shapes: list[list[tuple[int, ...]] | None]) -> None:
        """`state_shapes[i]`: layer i's recurrent state shapes, or None for an attention layer."""
        attention = [i for i, shapes in enumerate(state_shapes) if shapes is None]
        recurrent = [i for i, shapes in enumerate(state_shapes) if shapes is not None]
        self.attention = KVMemory(config, n_ctx, n_seq_max, kv_dtype, [layer_ropes[i] for i in attention])
        self.recurrent = RecurrentMemory(config, n_seq_max, [state_shapes[i] for i in recurrent])
        self.layer_home = [(0, attention.index(i)) if shapes is None else (1, recurrent.index(i))
                           for i, shapes in enumerate(state_shapes)]

    @property
    def pools(self) -> tuple[KVMemory, ...]:
        return self.attention.pools

    @property
    def n_cells(self) -> int:
        return self.attention.n_cells

    @property
    def n_used(self) -> int:
        return self.attention.n_used

    @property
    def kv_bytes(self) -> int:
        return self.attention.kv_bytes + self.recurrent.kv_bytes

    def cells_short(self, n_tokens: int) -> int:
        return self.attention.cells_short(n_tokens)

    def retain(self, seq_id: int) -> None:
        self.attention.retain(seq_id)

    # --- sequence operations: the recurrent part refuses first, so a refusal changes nothing ---
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return self.recurrent.seq_rm(seq_id, p0, p1) and self.attention.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.recurrent.seq_cp(src, dst, p0, p1)
        self.attention.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.recurrent.seq_keep(seq_id)
        self.attention.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.recurrent.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.recurrent.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.attention.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.attention.seq_pos_max(seq_id)

    def checkpoint(self, seq_id: int) -> tuple:
        return self.recurrent.checkpoint(seq_id)

    def restore(self, checkpoint: tuple) -> None:
        """The recurrent state as `checkpoint` took it, and the attention cells after its last position removed."""
        seq_id, (_, last), _ = checkpoint
        self.recurrent.restore(checkpoint)
        self.attention.seq_rm(seq_id, last + 1, -1)

    def clear(self) -> None:
        self.attention.clear()
        self.recurrent.clear()

    def compact(self) -> None:
        self.attention.compact()

    def state_seq_save(self, seq_id: int) -> bytes:
        return save_sequence(self.pools, seq_id, self.recurrent)

    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None:
        load_sequence(self.pools, data, dest_seq_id, self.recurrent)

    # --- a batch ---
    def apply_shifts(self) -> None:
        self.attention.apply_shifts()

    def split(self, batch, n_ubatch: int) -> list:
        return self.recurrent.split(batch, n_ubatch)

    def plan(self, ubatches) -> list[tuple[np.ndarray, np.ndarray]] | None:
        owners = self.recurrent.plan(ubatches)
        slots = self.attention.plan(ubatches)
        return None if slots is None else list(zip(slots, owners))

    def begin(self) -> None:
        self.attention.begin()
        self.recurrent.begin()

    def place(self, ubatch, plan: tuple[np.ndarray, np.ndarray]) -> LayerViews:
        views = (self.attention.place(ubatch, plan[0]), self.recurrent.place(ubatch, plan[1]))
        return LayerViews([(views[part], local) for part, local in self.layer_home])

    def commit(self) -> None:
        self.attention.commit()
        self.recurrent.commit()

    def roll_back(self) -> None:
        self.attention.roll_back()
        self.recurrent.roll_back()
