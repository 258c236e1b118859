"""Megatron-style shards of a model for tensor parallelism: which part of each tensor a rank reads, and its config.

Q, K and V (and their biases) and the MLP's gate and up are split by rows (column parallel: each rank computes
its heads and its part of the width); the attention output and the MLP's down projection by columns (row
parallel: each rank's product is a partial sum, added up over the ranks after it, see Decoder.all_reduce). The LM
head is split by vocabulary (each rank's logits gathered to rank 0, see Decoder.gather_logits); norms and
embeddings are replicated. A rank reads only its part of each tensor from the file.

Heads are split evenly. The MLP width is split at whole blocks of the down projection's format (its columns are
the width, and a quantized row can only be cut between blocks): Qwen2.5-0.5B's 4864 = 19 blocks of 256 go to two
ranks as 2560 and 2304. The per-rank config says n_head / N, n_head_kv / N and the rank's width, so the decoder,
the KV store and attention's grouping run unchanged on a shard.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlm.families import RECURRENT_KINDS
from kvlm.loader.config import ModelConfig
from kvlm.loader.tensors import block_weights
from kvlm.parallel.collectives import vocab_shares

COLUMN_PARALLEL = {"attn_q": "q", "attn_k": "kv", "attn_v": "kv", "ffn_gate": "ff", "ffn_up": "ff"}
ROW_PARALLEL = {"attn_output": "q", "ffn_down": "ff"}


def check_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, before any weight is read, a size that does not divide the heads."""
    check_size(size)
    recurrent = sorted(set(config.layer_kinds) & set(RECURRENT_KINDS))
    if recurrent and size > 1:
        raise ValueError(f"tensor parallelism is not supported for models with {recurrent[0]} layers")
    sizes = {name: getattr(config, name) for name in ("n_head", "n_head_kv")}
    undivided = {name: value for name, value in sizes.items() if value % size}
    if undivided:
        numbers = ", ".join(f"{name} = {value}" for name, value in undivided.items())
        divisors = [d for d in range(1, config.n_head_kv + 1) if not (config.n_head % d or config.n_head_kv % d)]
        raise ValueError(f"tensor_parallel_size {size} does not divide {numbers} of {config.name}: each rank must "
                         f"hold whole heads (sizes that work: {', '.join(map(str, divisors))})")


def ff_shares(n_ff: int, size: int, block: int = 1) -> list[int]:
    """Each rank's share of the MLP width, in whole blocks of `block` columns, as even as they can be."""
    if n_ff // block < size:
        raise ValueError(f"the MLP width {n_ff} holds {n_ff // block} blocks of {block}: too few for {size} ranks")
    return [share * block for share in vocab_shares(n_ff // block, size)]


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: its config and the part of each tensor it reads."""

    rank: int
    size: int
    whole_config: ModelConfig
    ff: tuple[int, ...]  # every rank's share of the MLP width

    @property
    def config(self) -> ModelConfig:
        c = self.whole_config
        return dataclasses.replace(c, n_head=c.n_head // self.size, n_head_kv=c.n_head_kv // self.size,
                                   n_ff=self.ff[self.rank])

    def _span(self, width: str) -> slice:
        c = self.whole_config
        if width == "ff":
            start = sum(self.ff[:self.rank])
            return slice(start, start + self.ff[self.rank])
        per_rank = (c.n_head if width == "q" else c.n_head_kv) // self.size * c.head_dim
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def part(self, name: str) -> tuple[slice | None, slice | None]:
        """(rows, columns) of a tensor this rank reads; None for all."""
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part in COLUMN_PARALLEL:
            return self._span(COLUMN_PARALLEL[part]), None
        if part in ROW_PARALLEL:
            return None, self._span(ROW_PARALLEL[part])
        return None, None

    def vocabulary_rows(self) -> slice:
        """This rank's rows of the LM head."""
        shares = vocab_shares(self.whole_config.vocab_size, self.size)
        first = sum(shares[:self.rank])
        return slice(first, first + shares[self.rank])


def make_shard(config: ModelConfig, file_types: dict[str, str], rank: int, size: int) -> Shard:
    """Rank `rank`'s shard; the MLP width split at the down projections' blocks (`file_types`: by tensor name)."""
    check_tensor_parallel(config, size)
    block = max((block_weights(stored) for name, stored in file_types.items() if name.endswith("ffn_down.weight")),
                default=1)
    return Shard(rank, size, config, tuple(ff_shares(config.n_ff, size, block)))
