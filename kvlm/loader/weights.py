"""The named tensors of a decoder, checked against the config, in GGUF naming."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.loader.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the decoder needs, [out, in] for matrices as torch's linear expects."""
    d = config.n_embd
    per_layer = config.family.layer_shapes(d, config.n_ff, config.n_head, config.n_head_kv, config.head_dim)
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    for layer in range(config.n_layer):
        for part, shape in per_layer.items():
            shapes[f"blk.{layer}.{part}"] = shape
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    return shapes


@dataclass
class ModelWeights:
    """float32 tensors by GGUF name; `output.weight` absent when tied to the embedding."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]

    def layer(self, index: int, part: str, kind: str = "weight") -> torch.Tensor:
        return self.tensors[f"blk.{index}.{part}.{kind}"]

    @property
    def output(self) -> torch.Tensor:
        return self.tensors.get("output.weight", self.tensors["token_embd.weight"])
