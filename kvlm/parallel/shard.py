"""Megatron-style shards of a model for tensor parallelism: each rank keeps 1/N of every layer's heads and MLP
width, so each caches only its KV heads.

Q, K and V (and their biases) and the MLP's gate and up are split by rows (column parallel: each rank computes
its heads and its part of the width); the attention output and the MLP's down projection by columns (row
parallel: each rank's product is a partial sum, added up over the ranks after it, see Decoder.all_reduce).
The LM head is split by vocabulary (each rank's logits gathered to rank 0, see Decoder.gather_logits); norms
and embeddings are replicated. The per-rank config says n_head / N, n_head_kv / N, n_ff / N,
so the decoder, the KV store and attention's grouping run unchanged on a shard.
"""
from __future__ import annotations

import dataclasses

from kvlm.families import RECURRENT_KINDS
from kvlm.fetch import resolve_model
from kvlm.load import Model, read_model
from kvlm.loader.config import ModelConfig
from kvlm.loader.weights import ModelWeights
from kvlm.model.decoder import Decoder
from kvlm.model.settings import ComputeSettings
from kvlm.parallel.collectives import vocab_shares

COLUMN_PARALLEL = {"attn_q": "q", "attn_k": "kv", "attn_v": "kv", "ffn_gate": "ff", "ffn_up": "ff"}
ROW_PARALLEL = {"attn_output": "q", "ffn_down": "ff"}


def check_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, before any weight is read, a size that does not divide the heads and the MLP width."""
    check_size(size)
    recurrent = sorted(set(config.layer_kinds) & set(RECURRENT_KINDS))
    if recurrent and size > 1:
        raise ValueError(f"tensor parallelism is not supported for models with {recurrent[0]} layers")
    sizes = {name: getattr(config, name) for name in ("n_head", "n_head_kv", "n_ff")}
    undivided = {name: value for name, value in sizes.items() if value % size}
    if undivided:
        numbers = ", ".join(f"{name} = {value}" for name, value in undivided.items())
        divisors = [d for d in range(1, config.n_head_kv + 1) if not (config.n_head % d or config.n_head_kv % d
                                                                       or config.n_ff % d)]
        raise ValueError(f"tensor_parallel_size {size} does not divide {numbers} of {config.name}: each rank must "
                         f"hold whole heads and an equal share of the MLP (sizes that work: "
                         f"{', '.join(map(str, divisors))})")


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
    # The LM head by vocabulary (its own tensor even when tied: the embedding stays whole).
    shares = vocab_shares(config.vocab_size, size)
    first = sum(shares[:rank])
    shards["output.weight"] = weights.output[first : first + shares[rank]].contiguous()
    file_types = dict(weights.file_types)
    if weights.output_name in file_types:
        file_types["output.weight"] = file_types[weights.output_name]
    return ModelWeights(shard_config(config, size), shards, file_types)


def load_shard(spec: str, rank: int, size: int, settings: ComputeSettings) -> Model:
    """This rank's shard of a model. Its decoder's row-parallel products are partial sums and its logits cover its
    share of the vocabulary: set its `all_reduce` and `gather_logits`. The whole model is read first."""
    source = resolve_model(spec, progress=False)
    config, weights, tokenizer = read_model(source)
    weights = shard_weights(weights, rank, size)  # checks the size (shard_config)
    return Model(weights.config, Decoder(weights.config, weights, settings), tokenizer, source)
