"""Which memory a model gets, decided once from its config: the kind (a unified KV cache, iSWA's full and sliding
pools, recurrent state slots, or a KV cache and slots), each K/V pool's layers and cells, and each recurrent layer's
state. `make_memory` allocates what `memory_layout` says; `MemoryLayout.nbytes` counts the same bytes without
allocating anything (the memory plan before loading, `kvlm inspect`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlm.core.config import ModelConfig
from kvlm.core.family import CONV, GATED_DELTA, MAMBA, RECURRENT_KINDS, SLIDING
from kvlm.core.rope import Rope
from kvlm.memory.hybrid import HybridMemory
from kvlm.memory.iswa import ISWAMemory, sliding_pool_cells
from kvlm.memory.kv_store import kv_bytes_for
from kvlm.memory.memory import KVMemory
from kvlm.memory.protocol import Memory
from kvlm.memory.recurrent import BANKS, RecurrentMemory

UNIFIED, ISWA, RECURRENT, HYBRID = "unified", "iswa", "recurrent", "hybrid"
RECURRENT_STATE_BYTES = 4  # a recurrent state is float32 (kvlm.memory.recurrent)


@dataclass(frozen=True)
class PoolLayout:
    """One pool of K/V rows: `layers` (those holding their own K/V; a layer reading another's holds none), each
    with rows of its kind's size, `n_cells` cells."""
    name: str  # "kv" (a unified or hybrid memory's one pool), "full" or "sliding" (iSWA's)
    layers: tuple[int, ...]
    n_cells: int

    def nbytes(self, config: ModelConfig, kv_dtype: str) -> int:
        return sum(kv_bytes_for(config, self.n_cells, kv_dtype, 1, config.layer_kinds[i]) for i in self.layers)


@dataclass(frozen=True)
class MemoryLayout:
    kind: str  # UNIFIED, ISWA, RECURRENT or HYBRID
    pools: tuple[PoolLayout, ...]  # none for a model of recurrent layers alone
    state_shapes: tuple[list[tuple[int, ...]] | None, ...]  # per layer: its state's shapes, None for attention

    @property
    def state_bytes(self) -> int:
        """One sequence's recurrent state, summed over the recurrent layers."""
        return sum(math.prod(shape) for shapes in self.state_shapes if shapes for shape in shapes) \
            * RECURRENT_STATE_BYTES

    def kv_bytes(self, config: ModelConfig, kv_dtype: str) -> int:
        return sum(pool.nbytes(config, kv_dtype) for pool in self.pools)

    def nbytes(self, config: ModelConfig, kv_dtype: str, n_seq_max: int, state_copies: int = 0) -> int:
        """Everything the memory allocates: the pools' K/V rows and two banks of recurrent state per sequence (the
        committed state and the one a batch writes, kvlm.memory.recurrent), and `state_copies` more states (the
        engine's prefix caching keeps copies of them)."""
        return self.kv_bytes(config, kv_dtype) + self.state_bytes * (BANKS * n_seq_max + state_copies)


def memory_layout(config: ModelConfig, n_ctx: int, n_seq_max: int = 1, n_ubatch: int = 512, swa_full: bool = False,
                  keep_extra: int = 0) -> MemoryLayout:
    """Recurrent state slots for a model of recurrent layers only, hybrid (KV cache + slots) for a mix; iSWA for
    a model with sliding-window layers: a full pool of n_ctx cells and a sliding one of a window per sequence and a
    micro-batch (llama.cpp's size; `keep_extra` more positions per sequence), unless `swa_full` (llama.cpp's option
    to keep every cell: then one unified pool whose sliding layers mask by window, or two of n_ctx cells where the
    two kinds' rows differ in size); else the unified KV cache."""
    state_shapes = tuple(recurrent_state_shapes(config, kind) for kind in config.layer_kinds)
    owners = config.kv_layers
    if all(shapes is not None for shapes in state_shapes):
        return MemoryLayout(RECURRENT, (), state_shapes)
    if any(shapes is not None for shapes in state_shapes):
        return MemoryLayout(HYBRID, (PoolLayout("kv", owners, n_ctx),), state_shapes)
    if SLIDING in config.layer_kinds and (not swa_full or config.full_head_dim):
        sliding = tuple(i for i in owners if config.layer_kinds[i] == SLIDING)
        full = tuple(i for i in owners if i not in sliding)
        n_sliding = n_ctx if swa_full else sliding_pool_cells(n_ctx, config.sliding_window, n_seq_max, n_ubatch,
                                                              keep_extra)
        return MemoryLayout(ISWA, (PoolLayout("full", full, n_ctx), PoolLayout("sliding", sliding, n_sliding)),
                            state_shapes)
    return MemoryLayout(UNIFIED, (PoolLayout("kv", owners, n_ctx),), state_shapes)


def make_memory(config: ModelConfig, layer_ropes: list[Rope], n_ctx: int, n_seq_max: int, n_ubatch: int,
                kv_dtype: str, swa_full: bool = False, swa_keep_extra: int = 0, spare_cell: bool = False) -> Memory:
    """The memory `memory_layout` decides, allocated; `layer_ropes[i]` re-rotates layer i's keys (context shift);
    `spare_cell`: its attention stores keep a row for a CUDA graph's padded lanes (not a recurrent one's: a
    memory with recurrent states is stepped eagerly)."""
    layout = memory_layout(config, n_ctx, n_seq_max, n_ubatch, swa_full, swa_keep_extra)
    if layout.kind == RECURRENT:
        return RecurrentMemory(config, n_seq_max, list(layout.state_shapes))
    if layout.kind == HYBRID:
        return HybridMemory(config, n_ctx, n_seq_max, kv_dtype, layer_ropes, list(layout.state_shapes))
    if layout.kind == ISWA:
        full, sliding = layout.pools
        return ISWAMemory(config, full, sliding, n_seq_max, n_ubatch, kv_dtype, layer_ropes, swa_keep_extra, swa_full,
                          spare_cell)
    owners = config.kv_layers
    windows = [config.sliding_window if config.layer_kinds[i] == SLIDING else 0 for i in owners]
    readers = [owners.index(config.kv_source(i)) for i in range(config.n_layer)] if config.n_kv_shared else None
    return KVMemory(config, n_ctx, n_seq_max, kv_dtype, [layer_ropes[i] for i in owners], layer_windows=windows,
                    readers=readers, spare_cell=spare_cell)


def memory_for(decoder, n_ctx: int, n_seq_max: int, n_ubatch: int, kv_dtype: str, swa_full: bool = False,
               swa_keep_extra: int = 0, spare_cell: bool = False) -> Memory:
    """`make_memory` for a decoder's model, on its device, the decoder fitted to n_ctx (see Decoder.fit_context)
    and each layer re-rotated by its RoPE."""
    layer_ropes = decoder.fit_context(n_ctx)
    with torch.device(decoder.device):  # the K/V cells and recurrent states where the decoder computes
        return make_memory(decoder.config, layer_ropes, n_ctx, n_seq_max, n_ubatch, kv_dtype, swa_full,
                           swa_keep_extra, spare_cell)


def memory_bytes(config: ModelConfig, n_ctx: int, n_seq_max: int, kv_dtype: str, n_ubatch: int = 512,
                 swa_full: bool = False, keep_extra: int = 0, state_copies: int = 0) -> int:
    """The bytes of the memory a model of this config gets (see memory_layout), with `state_copies` copies of one
    sequence's recurrent states (none held where it has no recurrent layers)."""
    return memory_layout(config, n_ctx, n_seq_max, n_ubatch, swa_full, keep_extra).nbytes(
        config, kv_dtype, n_seq_max, state_copies)


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
