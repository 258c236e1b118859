"""How many bytes a model's memory takes, from its config alone: what `make_memory` would allocate, computed
without allocating it (for the memory plan before loading, and for `kvlm inspect`)."""
from __future__ import annotations

import math

from kvlm.families import ATTENTION, SLIDING
from kvlm.loader.config import ModelConfig
from kvlm.memory.iswa import sliding_pool_cells
from kvlm.memory.kv_store import kv_bytes_for
from kvlm.memory.protocol import recurrent_state_shapes

RECURRENT_STATE_BYTES = 4  # a recurrent state is float32 (kvlm.memory.recurrent)


def iswa_pools(config: ModelConfig, n_ctx: int, n_seq_max: int = 1, n_ubatch: int = 512, keep_extra: int = 0,
               swa_full: bool = False) -> tuple[tuple[str, int, int], tuple[str, int, int]] | None:
    """(name, layers, cells) of the full and the sliding pool iSWA memory would allocate (as kvlm.memory.iswa
    sizes them: only layers holding their own K/V), or None for a model without sliding-window layers (one
    unified pool)."""
    owners = config.kv_layers
    n_sliding = sum(config.layer_kinds[i] == SLIDING for i in owners)
    if not any(kind == SLIDING for kind in config.layer_kinds):
        return None
    sliding_cells = n_ctx if swa_full else sliding_pool_cells(n_ctx, config.sliding_window, n_seq_max, n_ubatch,
                                                              keep_extra)
    return ("full", len(owners) - n_sliding, n_ctx), ("sliding", n_sliding, sliding_cells)


def pool_kv_bytes(config: ModelConfig, pool: tuple[str, int, int], kv_dtype: str) -> int:
    """The K/V bytes of one of iswa_pools' pools, its layers' rows of their kind's size."""
    name, n_layer, n_cells = pool
    return kv_bytes_for(config, n_cells, kv_dtype, n_layer, SLIDING if name == "sliding" else ATTENTION)


def recurrent_state(config: ModelConfig) -> tuple[int, int]:
    """(attention layers holding K/V, bytes of one sequence's recurrent state: float32, summed over the recurrent
    layers) as the recurrent and hybrid memories allocate them."""
    state = 0
    for kind in config.layer_kinds:
        shapes = recurrent_state_shapes(config, kind)
        if shapes is not None:
            state += sum(math.prod(shape) for shape in shapes) * RECURRENT_STATE_BYTES
    return len(config.kv_layers), state


def memory_bytes(config: ModelConfig, n_ctx: int, n_seq_max: int, kv_dtype: str, n_ubatch: int = 512,
                 swa_full: bool = False, keep_extra: int = 0) -> int:
    """The bytes of the memory a model of this config gets: KV rows of its attention layers that hold their own
    (in two pools for sliding-window layers unless `swa_full`, or even then when the two kinds' rows differ in
    size) and a recurrent state per sequence for its other layers."""
    n_attention, state = recurrent_state(config)
    if state:
        return kv_bytes_for(config, n_ctx, kv_dtype, n_attention) + state * n_seq_max
    two_pools = not swa_full or config.full_head_dim
    pools = iswa_pools(config, n_ctx, n_seq_max, n_ubatch, keep_extra, swa_full) if two_pools else None
    if pools is None:
        return kv_bytes_for(config, n_ctx, kv_dtype)
    return sum(pool_kv_bytes(config, pool, kv_dtype) for pool in pools)
