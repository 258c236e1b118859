"""Megatron-style shards of a model for tensor parallelism: which part of each tensor a rank reads, and its config.

Q, K and V (and their biases) and the MLP's gate and up are split by rows (column parallel: each rank computes
its heads and its part of the width); the attention output and the MLP's down projection by columns (row
parallel: each rank's product is a partial sum, added up over the ranks after it, see Decoder.all_reduce). The LM
head is split by vocabulary (each rank's logits gathered to rank 0, see Decoder.gather_logits); norms and
embeddings are replicated. A rank reads only its part of each tensor from the file.

A mixture-of-experts layer is split the same way inside each expert: every rank holds every expert, with its share
of each expert's width (gate and up by rows, down by columns), and of the shared expert's; routers are replicated.
gpt-oss's experts' gate and up biases split with their rows; the down projection's bias (and the attention output's)
is held whole and added once (by rank 0, and after the all-reduce); its attention sinks go with their heads.
Each rank then routes a token to the same experts as the others (same input, same router), each computes its share
of them, and the partial sums are added up as the MLP's are. Splitting the experts themselves between ranks instead
would leave a rank idle whenever a token's experts all live on the other (top-k of a few ranks is rarely even), and
make the ranks' work differ from step to step.

Heads are split evenly. The MLP width is split at whole blocks of the down projection's format (its columns are
the width, and a quantized row can only be cut between blocks): Qwen2.5-0.5B's 4864 = 19 blocks of 256 go to two
ranks as 2560 and 2304. The per-rank config says n_head / N, n_head_kv / N and the rank's width, so the decoder,
the KV store and attention's grouping run unchanged on a shard.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvlm.core.family import RECURRENT_KINDS
from kvlm.core.config import ModelConfig
from kvlm.loader.tensors import block_weights
from kvlm.parallel.collectives import vocab_shares

COLUMN_PARALLEL = {"attn_q": "q", "attn_k": "kv", "attn_v": "kv", "ffn_gate": "ff", "ffn_up": "ff",
                   "ffn_gate_exps": "ff_exp", "ffn_up_exps": "ff_exp", "ffn_gate_shexp": "ff_shexp",
                   "ffn_up_shexp": "ff_shexp"}
ROW_PARALLEL = {"attn_output": "q", "ffn_down": "ff", "ffn_down_exps": "ff_exp", "ffn_down_shexp": "ff_shexp"}
_WIDTHS = {"ff": ("n_ff", "ffn_down"), "ff_exp": ("n_ff_exp", "ffn_down_exps"),
           "ff_shexp": ("n_ff_shexp", "ffn_down_shexp")}  # each width, and the tensor whose blocks cut it


def check_size(size: int) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, before any weight is read, a size that does not divide the heads."""
    check_size(size)
    recurrent = sorted(set(config.layer_kinds) & set(RECURRENT_KINDS))
    if recurrent and size > 1:
        raise ValueError(f"tensor parallelism is not supported for models with {recurrent[0]} layers")
    if not config.family.tensor_parallel and size > 1:
        raise ValueError(f"tensor parallelism is not supported for {config.architecture} models")
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
    widths: dict[str, tuple[int, ...]]  # every rank's share of each width: "ff" (the MLP's), and the experts'

    @property
    def config(self) -> ModelConfig:
        c = self.whole_config
        share = {field: self.widths[width][self.rank] for width, (field, _) in _WIDTHS.items() if width in self.widths}
        return dataclasses.replace(c, n_head=c.n_head // self.size, n_head_kv=c.n_head_kv // self.size, **share)

    def _span(self, width: str) -> slice:
        c = self.whole_config
        if width in self.widths:
            shares = self.widths[width]
            start = sum(shares[:self.rank])
            return slice(start, start + shares[self.rank])
        per_rank = (c.n_head if width == "q" else c.n_head_kv) // self.size * c.head_dim
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def part(self, name: str) -> tuple[slice | None, slice | None]:
        """(rows, columns) of a tensor this rank reads; None for all."""
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part == "attn_sinks":  # one per query head
            per_rank = self.whole_config.n_head // self.size
            return slice(self.rank * per_rank, (self.rank + 1) * per_rank), None
        if name.endswith("_exps.bias"):  # [expert, width]: gate's and up's split as their rows; down's whole
            return (None, self._span(COLUMN_PARALLEL[part])) if part in COLUMN_PARALLEL else (None, None)
        if part in ROW_PARALLEL and name.endswith(".bias"):  # whole: added once, after the ranks' partial sums
            return None, None
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
    """Rank `rank`'s shard; the MLP's and the experts' widths split at their down projections' blocks (`file_types`:
    by tensor name)."""
    check_tensor_parallel(config, size)
    widths = {}
    for width, (field, down) in _WIDTHS.items():
        if getattr(config, field) == 0 or (width == "ff" and all(config.moe_layers)):
            continue  # a width no layer has
        block = max((block_weights(stored) for name, stored in file_types.items() if name.endswith(f"{down}.weight")),
                    default=1)
        widths[width] = tuple(ff_shares(getattr(config, field), size, block))
    return Shard(rank, size, config, widths)
