"""The named tensors of a decoder, checked against the config, in GGUF naming, read one at a time.

`ModelWeights` holds no weights: it knows every tensor's shape and stored type (from the file's header, checked
before anything is read) and reads a tensor only when asked, as the file stores it (see kvlm.loader.tensors).
The decoder asks for each once, converts it to its kernel's form and lets it go, so a model is never in memory
twice. A tensor-parallel rank's weights read only its shard of each tensor (`shard`, see kvlm.loader.shard).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvlm.core.config import ModelConfig
from kvlm.loader.tensors import Entry, GGUFTensors, SafetensorsTensors, Stored


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the decoder needs, [out, in] for matrices as torch's linear expects."""
    d = config.n_embd
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    if config.per_layer_embd:  # Gemma 4's per-layer inputs: a table and a projection for every layer at once
        width = config.n_layer * config.per_layer_embd
        shapes.update({"per_layer_token_embd.weight": (config.vocab_size, width),
                       "per_layer_model_proj.weight": (width, d), "per_layer_proj_norm.weight": (config.per_layer_embd,)})
    for layer in range(config.n_layer):
        for part, shape in config.family.layer_shapes(layer, config).items():
            shapes[f"blk.{layer}.{part}"] = shape
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    return shapes


@dataclass
class ModelWeights:
    """A model's tensors by GGUF name; `output.weight` absent when tied to the embedding.

    `on_read(name, nbytes)` is told of every tensor read (a progress bar). With a `shard`, `config` is the rank's
    own (its share of the heads and the MLP) and every read returns the rank's part of the tensor.
    """

    config: ModelConfig
    source: GGUFTensors | SafetensorsTensors
    shard: object | None = None  # kvlm.loader.shard.Shard
    on_read: Callable[[str, int], None] | None = field(default=None, repr=False)

    def entry(self, name: str) -> Entry:
        """What the file says of a tensor; with a shard, of the part this rank reads."""
        whole = self.source.entry(name)
        if self.shard is None or whole is None:
            return whole
        rows, cols = self.shard.part(name)
        return _part_of(whole, rows, cols)

    def head_entry(self) -> Entry:
        """The LM head's entry: its own tensor's or the embedding's; with a shard, its rows of the vocabulary."""
        whole = self.source.entry(self.output_name)
        return whole if self.shard is None else _part_of(whole, self.shard.vocabulary_rows(), None)

    def file_type(self, name: str) -> str:
        """How the file stores a tensor: a GGUF type name ("Q4_K", "F32") or a torch dtype name ("bfloat16")."""
        return self.entry(name).stored_as

    def read(self, name: str) -> Stored:
        rows, cols = self.shard.part(name) if self.shard is not None else (None, None)
        value = self.source.read(name, rows, cols)
        expected = self._shapes.get(name)
        if isinstance(value, torch.Tensor) and expected and value.shape != expected and value.numel() == math.prod(expected):
            value = value.reshape(expected)  # a vector a file stores as [n, 1] (Mamba2's A and D in GGUF)
        if self.on_read is not None:
            self.on_read(name, self.entry(name).nbytes)
        return value

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_shapes(self.config)

    def layer(self, index: int, part: str, kind: str = "weight") -> Stored:
        return self.read(self.layer_name(index, part, kind))

    @staticmethod
    def layer_name(index: int, part: str, kind: str = "weight") -> str:
        return f"blk.{index}.{part}.{kind}"

    @property
    def output_name(self) -> str:
        return "output.weight" if self.source.entry("output.weight") is not None else "token_embd.weight"

    def output(self) -> Stored:
        """The LM head: its own tensor, or the embedding's rows (a shard's share of the vocabulary)."""
        if self.shard is None:
            return self.read(self.output_name)
        value = self.source.read(self.output_name, self.shard.vocabulary_rows(), None)
        if self.on_read is not None:
            self.on_read(self.output_name, self.head_entry().nbytes)
        return value

    def names(self) -> list[str]:
        return list(expected_shapes(self.config if self.shard is None else self.shard.whole_config))

    def bytes_per_token(self) -> tuple[int, int]:
        """(bytes of the file a token reads, bytes of the file's weights), as the file stores them: every matrix and
        vector, the LM head, and of each layer's experts only the n_expert_used a token is routed to; the embedding's
        one row aside (unless it is the LM head too)."""
        c, active, total = self.config, 0, 0
        tied = self.output_name == "token_embd.weight"
        for name in self.names():
            nbytes = self.entry(name).nbytes
            total += nbytes
            if name == "token_embd.weight" and not tied:
                continue
            active += nbytes * c.n_expert_used // c.n_expert if name.endswith("_exps.weight") else nbytes
        return active, total


def _part_of(whole: Entry, rows: slice | None, cols: slice | None) -> Entry:
    """The entry of rows x cols of a tensor (its bytes in proportion: a part is whole rows or whole blocks)."""
    shape = list(whole.shape)
    for axis, span in ((0, rows), (1, cols)):
        if span is not None:
            shape[axis] = len(range(*span.indices(shape[axis])))
    return Entry(tuple(shape), whole.stored_as, whole.nbytes * math.prod(shape) // math.prod(whole.shape))
