"""The memory protocol (after llama.cpp's llama_memory_i) and the choice of a memory kind for a model.

Context and the engine talk only to this protocol. A decode plans the whole batch as a dry run (nothing changes
if it does not fit), then for each micro-batch `place`s it and runs the forward pass through the view it gets,
then `commit`s, or `roll_back`s to exactly the state before the batch. A kind that cannot do an operation says
so (seq_rm answers False; other operations raise CacheError) and changes nothing.
"""
from __future__ import annotations

from typing import Protocol

from kvlm.families import CONV, GATED_DELTA, MAMBA, RECURRENT_KINDS, SLIDING
from kvlm.loader.config import ModelConfig
from kvlm.memory.hybrid import HybridMemory
from kvlm.memory.iswa import ISWAMemory
from kvlm.memory.memory import KVMemory
from kvlm.memory.recurrent import RecurrentMemory
from kvlm.memory.view import KVView, LayerViews
from kvlm.model.rope import Rope


class Memory(Protocol):
    kind: str  # "unified", "iswa", "recurrent" or "hybrid"

    @property
    def pools(self) -> tuple[KVMemory, ...]:
        """Its pools of cells, each with its own cells, K/V store and sliding `window` (0: every position)."""

    @property
    def n_cells(self) -> int: ...
    @property
    def n_used(self) -> int: ...
    @property
    def kv_bytes(self) -> int: ...

    def cells_short(self, n_tokens: int) -> int:
        """How many cells are missing for n_tokens more tokens (0: they fit)."""

    def retain(self, seq_id: int) -> None:
        """seq_id holds cells for others (a prefix cache): never pruned, its window never checked."""

    def share(self, block: list, seq_id: int) -> None:
        """Add seq_id to used cells, named per pool (a prefix cache lending a block)."""
    def unshare(self, block: list, seq_id: int) -> None:
        """Remove seq_id from those cells; cells left without a sequence are freed."""

    # sequence operations, as llama.cpp's
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_keep(self, seq_id: int) -> None: ...
    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def clear(self) -> None: ...
    def compact(self) -> None: ...
    def state_seq_save(self, seq_id: int) -> bytes: ...
    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None: ...

    # speculative decoding: taking guessed tokens back
    def checkpoint(self, seq_id: int) -> object:
        """What `restore` needs to put the sequence back as it is now, when seq_rm cannot remove a tail of it
        (a recurrent state); None for the KV kinds, whose tails seq_rm removes."""
    def restore(self, checkpoint: object) -> None: ...

    # a batch
    def apply_shifts(self) -> None: ...
    def split(self, batch, n_ubatch: int) -> list:
        """The batch's micro-batches: in order (KV kinds), or as many tokens per sequence in each (recurrent)."""
    def plan(self, ubatches) -> list | None:
        """Where each micro-batch goes; None if it does not fit; InvalidBatch for what the kind cannot take."""
    def begin(self) -> None: ...
    def place(self, ubatch, slot) -> KVView | LayerViews: ...
    def commit(self) -> None: ...
    def roll_back(self) -> None: ...


def make_memory(config: ModelConfig, layer_ropes: list[Rope], n_ctx: int, n_seq_max: int, n_ubatch: int,
                kv_dtype: str, swa_full: bool = False, swa_keep_extra: int = 0) -> Memory:
    """Recurrent state slots for a model of recurrent layers only, hybrid (KV cache + slots) for a mix; iSWA for
    a model with sliding-window layers (unless `swa_full`, llama.cpp's option to keep every cell: then one unified
    pool whose sliding layers mask by window); else the unified KV cache."""
    state_shapes = [recurrent_state_shapes(config, kind) for kind in config.layer_kinds]
    if all(shapes is not None for shapes in state_shapes):
        return RecurrentMemory(config, n_seq_max, state_shapes)
    if any(shapes is not None for shapes in state_shapes):
        return HybridMemory(config, n_ctx, n_seq_max, kv_dtype, layer_ropes, state_shapes)
    sliding = [kind == SLIDING for kind in config.layer_kinds]
    if any(sliding) and (not swa_full or config.full_head_dim):  # rows of two sizes need two pools
        return ISWAMemory(config, n_ctx, n_seq_max, n_ubatch, kv_dtype, layer_ropes, sliding, swa_keep_extra,
                          swa_full)
    owners = config.kv_layers
    windows = [config.sliding_window if sliding[i] else 0 for i in owners]
    readers = [owners.index(config.kv_source(i)) for i in range(config.n_layer)] if config.n_kv_shared else None
    return KVMemory(config, n_ctx, n_seq_max, kv_dtype, [layer_ropes[i] for i in owners], layer_windows=windows,
                    readers=readers)


def memory_for(decoder, n_ctx: int, n_seq_max: int, n_ubatch: int, kv_dtype: str, swa_full: bool = False,
               swa_keep_extra: int = 0) -> Memory:
    """`make_memory` for a decoder's model, each layer re-rotated by the decoder's RoPE for its kind."""
    layer_ropes = [decoder.layer_rope(kind) for kind in decoder.config.layer_kinds]
    return make_memory(decoder.config, layer_ropes, n_ctx, n_seq_max, n_ubatch, kv_dtype, swa_full, swa_keep_extra)


def recurrent_state_shapes(config: ModelConfig, kind: str) -> list[tuple[int, ...]] | None:
    """The state a recurrent layer keeps per sequence; None for an attention layer."""
    if kind not in RECURRENT_KINDS:
        return None
    if kind == CONV:
        return [(config.n_embd, config.conv_kernel - 1)]  # the convolution's last inputs
    if kind == MAMBA:
        conv_dim = config.ssm_inner + 2 * config.ssm_groups * config.ssm_state
        return [(conv_dim, config.conv_kernel - 1), (config.n_head, config.head_dim, config.ssm_state)]
    if kind == GATED_DELTA:  # the convolution's last Q/K/V inputs; per value head, a key-size x value-size state
        conv_dim = 2 * config.ssm_groups * config.ssm_state + config.ssm_inner
        return [(conv_dim, config.conv_kernel - 1),
                (config.ssm_heads, config.ssm_state, config.ssm_inner // config.ssm_heads)]
    raise AssertionError(f"no state shapes for layer kind {kind!r}")
