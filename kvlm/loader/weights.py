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
from typing import TYPE_CHECKING

import torch

from kvlm.core.config import ModelConfig
from kvlm.loader.tensors import Entry, GGUFTensors, SafetensorsTensors, Stored

if TYPE_CHECKING:  # (the tile cache's size is parsed by the memory plan, which reads these weights' entries)
    from kvlm.loader.tensors import Layout
    from kvlm.loader.tile_cache import TileCache


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


def fused_parts(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """Tensors the family's files store stacked by rows in one (Phi-3's attn_qkv, its gate and up as ffn_up): each
    part's name -> (the stored tensor's name, the part's first row in it), the parts' rows as `expected_shapes`."""
    shapes, fused = expected_shapes(config), {}
    for layer in range(config.n_layer):
        for stored, parts in config.family.fused_tensors:
            first = 0
            for part in parts:
                fused[f"blk.{layer}.{part}"] = (f"blk.{layer}.{stored}", first)
                first += shapes[f"blk.{layer}.{part}"][0]
    return fused


def stored_shapes(config: ModelConfig, fused: dict[str, tuple[str, int]]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor the file must hold: `expected_shapes`, the fused parts as the tensors holding them."""
    shapes = expected_shapes(config)
    stored = {name: shape for name, shape in shapes.items() if name not in fused}
    for part, (name, first) in fused.items():
        rows, *rest = shapes[part]
        stored[name] = (max(stored.get(name, (0,))[0], first + rows), *rest)
    return stored


@dataclass
class ModelWeights:
    """A model's tensors by GGUF name; `output.weight` absent when tied to the embedding.

    `on_read(name, nbytes)` is told of every tensor read (a progress bar). With a `shard`, `config` is the rank's
    own (its share of the heads and the MLP) and every read returns the rank's part of the tensor. `fused`: the
    parts of tensors the file stores stacked (see fused_parts), each read as its rows of the stored tensor. `tiles`:
    where matrices read in the native products' layout are kept for the next load (see kvlm.loader.tile_cache).
    """

    config: ModelConfig
    source: GGUFTensors | SafetensorsTensors
    shard: object | None = None  # kvlm.loader.shard.Shard
    on_read: Callable[[str, int], None] | None = field(default=None, repr=False)
    fused: dict[str, tuple[str, int]] = field(default_factory=dict)
    tiles: TileCache | None = None  # matrices already in the native products' tiles, from an earlier load

    def _where(self, name: str) -> tuple[str, slice | None, slice | None]:
        """(the stored tensor, its rows, its columns) that hold this rank's part of a tensor; None for all."""
        rows, cols = self.shard.part(name) if self.shard is not None else (None, None)
        if name not in self.fused:
            return name, rows, cols
        stored, first = self.fused[name]
        n_rows = self._whole_shapes[name][0]
        start, stop, _ = (rows or slice(None)).indices(n_rows)
        return stored, slice(first + start, first + stop), cols

    def entry(self, name: str) -> Entry:
        """What the file says of a tensor; with a shard, of the part this rank reads."""
        stored, rows, cols = self._where(name)
        whole = self.source.entry(stored)
        if whole is None or (rows is None and cols is None):
            return whole
        return _part_of(whole, rows, cols)

    def head_entry(self) -> Entry:
        """The LM head's entry: its own tensor's or the embedding's; with a shard, its rows of the vocabulary."""
        whole = self.source.entry(self.output_name)
        return whole if self.shard is None else _part_of(whole, self.shard.vocabulary_rows(), None)

    def file_type(self, name: str) -> str:
        """How the file stores a tensor: a GGUF type name ("Q4_K", "F32") or a torch dtype name ("bfloat16")."""
        return self.entry(name).stored_as

    def read(self, name: str, layout: Layout | None = None) -> Stored:
        """The tensor (this rank's part of it) as the file stores it, or, with `layout` (the native products': a
        block matrix rearranged in place), in that layout: from the tile cache where it holds it."""
        stored, rows, cols = self._where(name)
        entry = self.entry(name)
        value = self._read(stored, rows, cols, entry, layout)
        expected = self._shapes.get(name)
        if isinstance(value, torch.Tensor) and expected and value.shape != expected and value.numel() == math.prod(expected):
            value = value.reshape(expected)  # a vector a file stores as [n, 1] (Mamba2's A and D in GGUF)
        if self.on_read is not None:
            self.on_read(name, entry.nbytes)
        return value

    def _read(self, stored: str, rows: slice | None, cols: slice | None, entry: Entry,
              layout: Layout | None) -> Stored:
        make = lambda: self.source.read(stored, rows, cols, layout)  # noqa: E731
        return make() if self.tiles is None or layout is None else self.tiles.read((stored, rows, cols), entry, make)

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_shapes(self.config)

    @cached_property
    def _whole_shapes(self) -> dict[str, tuple[int, ...]]:
        """The whole model's shapes (a rank's config holds its share)."""
        return self._shapes if self.shard is None else expected_shapes(self.shard.whole_config)

    def layer(self, index: int, part: str, kind: str = "weight") -> Stored:
        return self.read(self.layer_name(index, part, kind))

    @staticmethod
    def layer_name(index: int, part: str, kind: str = "weight") -> str:
        return f"blk.{index}.{part}.{kind}"

    @property
    def output_name(self) -> str:
        return "output.weight" if self.source.entry("output.weight") is not None else "token_embd.weight"

    def output(self, layout: Layout | None = None) -> Stored:
        """The LM head: its own tensor, or the embedding's rows (a shard's share of the vocabulary); `layout` as
        `read`'s."""
        if self.shard is None:
            return self.read(self.output_name, layout)
        entry = self.head_entry()
        value = self._read(self.output_name, self.shard.vocabulary_rows(), None, entry, layout)
        if self.on_read is not None:
            self.on_read(self.output_name, entry.nbytes)
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
    """The entry of rows x cols of a tensor (of each expert's matrix in a tensor of experts [expert, rows, cols]),
    its bytes in proportion: a part is whole rows or whole blocks."""
    shape = list(whole.shape)
    row_axis = max(0, len(shape) - 2)
    for axis, span in ((row_axis, rows), (row_axis + 1, cols)):
        if span is not None:
            shape[axis] = len(range(*span.indices(shape[axis])))
    return Entry(tuple(shape), whole.stored_as, whole.nbytes * math.prod(shape) // math.prod(whole.shape))
