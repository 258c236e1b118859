"""The named tensors of a decoder, checked against the config, in GGUF naming."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.loader.config import ModelConfig

LAYER_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the decoder needs, [out, in] for matrices as torch's linear expects."""
    d, ff, hd = config.n_embd, config.n_ff, config.head_dim
    q_rows, kv_rows = config.n_head * hd, config.n_head_kv * hd
    per_layer = {
        "attn_norm": (d,), "attn_q": (q_rows, d), "attn_k": (kv_rows, d), "attn_v": (kv_rows, d),
        "attn_output": (d, q_rows), "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff),
    }
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    for layer in range(config.n_layer):
        for part in LAYER_TENSORS:
            shapes[f"blk.{layer}.{part}.weight"] = per_layer[part]
    shapes["output.weight"] = (config.vocab_size, d)
    return shapes


@dataclass
class ModelWeights:
    """float32 tensors by GGUF name; `output.weight` absent when tied to the embedding."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]

    def layer(self, index: int, part: str) -> torch.Tensor:
        return self.tensors[f"blk.{index}.{part}.weight"]

    @property
    def output(self) -> torch.Tensor:
        return self.tensors.get("output.weight", self.tensors["token_embd.weight"])
