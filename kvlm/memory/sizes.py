"""How many bytes a model's memory takes, from its config alone: what `make_memory` would allocate, computed
without allocating it (for the memory plan before loading, and for `kvlm inspect`)."""
from __future__ import annotations

import math

from kvlm.families import SLIDING
from kvlm.loader.config import ModelConfig
from kvlm.memory.iswa import sliding_pool_cells
from kvlm.memory.kv_store import kv_bytes_for
from kvlm.memory.protocol import recurrent_state_shapes

RECURRENT_STATE_BYTES = 4  # a recurrent state is float32 (kvlm.memory.recurrent)


def iswa_pools(config: ModelConfig, n_ctx: int, n_seq_max: int = 1, n_ubatch: int = 512,
               keep_extra: int = 0) -> tuple[tuple[str, int, int], tuple[str, int, int]] | None:
    """(name, layers, cells) of the full and the sliding pool iSWA memory would allocate (as kvlm.memory.iswa
    sizes them), or None for a model without sliding-window layers (one unified pool)."""
    n_sliding = sum(kind == SLIDING for kind in config.layer_kinds)
    if n_sliding == 0:
        return None
    sliding_cells = sliding_pool_cells(n_ctx, config.sliding_window, n_seq_max, n_ubatch, keep_extra)
    return ("full", config.n_layer - n_sliding, n_ctx), ("sliding", n_sliding, sliding_cells)


def recurrent_state(config: ModelConfig) -> tuple[int, int]:
    """(attention layers, bytes of one sequence's recurrent state: float32, summed over the recurrent layers) as
    the recurrent and hybrid memories allocate them."""
    n_attention, state = 0, 0
    for kind in config.layer_kinds:
        shapes = recurrent_state_shapes(config, kind)
        if shapes is None:
            n_attention += 1
        else:
            state += sum(math.prod(shape) for shape in shapes) * RECURRENT_STATE_BYTES
    return n_attention, state


def memory_bytes(config: ModelConfig, n_ctx: int, n_seq_max: int, kv_dtype: str, n_ubatch: int = 512,
                 swa_full: bool = False, keep_extra: int = 0) -> int:
    """The bytes of the memory a model of this config gets: KV rows of its attention layers (in two pools for
    sliding-window layers unless `swa_full`) and a recurrent state per sequence for its other layers."""
    n_attention, state = recurrent_state(config)
    if state:
        return kv_bytes_for(config, n_ctx, kv_dtype, n_attention) + state * n_seq_max
    pools = None if swa_full else iswa_pools(config, n_ctx, n_seq_max, n_ubatch, keep_extra)
    if pools is None:
        return kv_bytes_for(config, n_ctx, kv_dtype)
    return sum(kv_bytes_for(config, cells, kv_dtype, n_layer) for _, n_layer, cells in pools)
