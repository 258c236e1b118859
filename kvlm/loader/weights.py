"""The named tensors of a decoder, checked against the config, in GGUF naming."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlm.loader.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the decoder needs, [out, in] for matrices as torch's linear expects."""
    d = config.n_embd
    per_kind = {kind: config.family.layer_shapes(kind, config) for kind in set(config.layer_kinds)}
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    for layer, kind in enumerate(config.layer_kinds):
        for part, shape in per_kind[kind].items():
            shapes[f"blk.{layer}.{part}"] = shape
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    return shapes


@dataclass
class ModelWeights:
    """float32 tensors by GGUF name; `output.weight` absent when tied to the embedding.

    `file_types` names how the file stored each tensor (GGUF type names such as "Q4_K"; absent for float
    tensors of a Hugging Face folder), so a quantized file's precision can be kept.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    file_types: dict[str, str] = field(default_factory=dict)

    def layer(self, index: int, part: str, kind: str = "weight") -> torch.Tensor:
        return self.tensors[self.layer_name(index, part, kind)]

    @staticmethod
    def layer_name(index: int, part: str, kind: str = "weight") -> str:
        return f"blk.{index}.{part}.{kind}"

    def file_type(self, name: str) -> str:
        return self.file_types.get(name, "float")

    @property
    def output_name(self) -> str:
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    @property
    def output(self) -> torch.Tensor:
        return self.tensors[self.output_name]
