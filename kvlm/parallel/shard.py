"""Megatron-style shards of a model for tensor parallelism: each rank keeps 1/N of every layer's heads and MLP
width, so each caches only its KV heads.

Q, K and V (and their biases) and the MLP's gate and up are split by rows (column parallel: each rank computes
its heads and its part of the width); the attention output and the MLP's down projection by columns (row
parallel: each rank's product is a partial sum, added up over the ranks after it, see Decoder.all_reduce).
Norms, embeddings and the LM head are replicated. The per-rank config says n_head / N, n_head_kv / N, n_ff / N,
so the decoder, the KV store and attention's grouping run unchanged on a shard.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed

from kvlm.families import RECURRENT_KINDS
from kvlm.fetch import resolve_model
from kvlm.load import Model, read_model
from kvlm.loader.config import ModelConfig
from kvlm.loader.weights import ModelWeights
from kvlm.model.decoder import Decoder
from kvlm.model.settings import AUTO, resolve_settings

COLUMN_PARALLEL = {"attn_q": "q", "attn_k": "kv", "attn_v": "kv", "ffn_gate": "ff", "ffn_up": "ff"}
ROW_PARALLEL = {"attn_output": "q", "ffn_down": "ff"}


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, before any weight is read, a size that does not divide the heads and the MLP width."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    recurrent = sorted(set(config.layer_kinds) & set(RECURRENT_KINDS))
    if recurrent and size > 1:
        raise ValueError(f"tensor parallelism is not supported for models with {recurrent[0]} layers")
    for name in ("n_head", "n_head_kv", "n_ff"):
        value = getattr(config, name)
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {name} = {value} of {config.name}: "
                             f"each rank must hold whole heads (try a divisor of {value})")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    check_tensor_parallel(config, size)
    return dataclasses.replace(config, n_head=config.n_head // size, n_head_kv=config.n_head_kv // size,
                               n_ff=config.n_ff // size)


def shard_weights(weights: ModelWeights, rank: int, size: int) -> ModelWeights:
    """Rank `rank`'s share of every layer tensor; whole-model tensors and norms as they are."""
    config = weights.config
    widths = {"q": config.n_head // size * config.head_dim, "kv": config.n_head_kv // size * config.head_dim,
              "ff": config.n_ff // size}
    shards = {}
    for name, tensor in weights.tensors.items():
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part in COLUMN_PARALLEL:
            width = widths[COLUMN_PARALLEL[part]]
            tensor = tensor[rank * width : (rank + 1) * width]
        elif part in ROW_PARALLEL:
            width = widths[ROW_PARALLEL[part]]
            tensor = tensor[:, rank * width : (rank + 1) * width]
        shards[name] = tensor.contiguous()
    return ModelWeights(shard_config(config, size), shards, dict(weights.file_types))


def load_shard(spec: str, rank: int, size: int, dtype: str = AUTO, quant: str | None = AUTO) -> Model:
    """This rank's shard of a model, whose row-parallel sums go through torch.distributed's all-reduce (the
    process group must be initialized)."""
    source = resolve_model(spec)
    config, weights, tokenizer = read_model(source)
    check_tensor_parallel(config, size)
    weights = shard_weights(weights, rank, size)
    decoder = Decoder(weights.config, weights, resolve_settings(dtype, quant))
    decoder.all_reduce = torch.distributed.all_reduce
    return Model(weights.config, decoder, tokenizer, source)
