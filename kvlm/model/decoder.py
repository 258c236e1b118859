"""A Llama-family decoder on torch: embeddings, N x (attention + SwiGLU), final norm, LM head."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlm.loader.config import ModelConfig
from kvlm.loader.weights import ModelWeights
from kvlm.memory.view import KVView
from kvlm.model.ops import apply_rope, grouped_attention, rms_norm, rope_cos_sin, rope_inv_freq, swiglu

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor       # Q, K and V projections stacked: one matmul instead of three
    attn_output: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor   # gate and up projections stacked
    down: torch.Tensor


class Decoder:
    def __init__(self, config: ModelConfig, weights: ModelWeights, dtype: str = "float32") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.config = config
        self.dtype = DTYPES[dtype]
        cast = lambda t: t.to(self.dtype).contiguous()  # noqa: E731
        self.layers = [
            LayerWeights(
                attn_norm=cast(weights.layer(i, "attn_norm")),
                qkv=cast(torch.cat([weights.layer(i, p) for p in ("attn_q", "attn_k", "attn_v")])),
                attn_output=cast(weights.layer(i, "attn_output")),
                ffn_norm=cast(weights.layer(i, "ffn_norm")),
                gate_up=cast(torch.cat([weights.layer(i, "ffn_gate"), weights.layer(i, "ffn_up")])),
                down=cast(weights.layer(i, "ffn_down")),
            )
            for i in range(config.n_layer)
        ]
        self.token_embd = cast(weights.tensors["token_embd.weight"])
        self.output_norm = cast(weights.tensors["output_norm.weight"])
        self.output = self.token_embd if config.tie_word_embeddings else cast(weights.output)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVView, output_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits [n_out, vocab] for the tokens at `output_rows` (all tokens when None).

        Each layer writes the K/V of `tokens` through `kv` before attending over the visible rows;
        nothing here makes those rows visible to later calls: the cache's commit does that.
        """
        x = self.token_embd[tokens]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(index, layer, rms_norm(x, layer.attn_norm, self.config.rms_norm_eps), cos, sin, kv)
            x = x + swiglu(rms_norm(x, layer.ffn_norm, self.config.rms_norm_eps), layer.gate_up, layer.down)
        if output_rows is not None:
            x = x[output_rows]
        return F.linear(rms_norm(x, self.output_norm, self.config.rms_norm_eps), self.output).float()

    def _attention(self, index: int, layer: LayerWeights, h, cos, sin, kv: KVView) -> torch.Tensor:
        c = self.config
        q_size, kv_size = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        n_tokens = h.shape[0]
        qk, v = F.linear(h, layer.qkv).split((q_size + kv_size, kv_size), dim=-1)
        # Q and K heads side by side take their rotation in one go.
        q, k = apply_rope(qk.view(n_tokens, c.n_head + c.n_head_kv, c.head_dim), cos, sin).split(
            (c.n_head, c.n_head_kv), dim=1
        )
        kv.write(index, k, v.view(n_tokens, c.n_head_kv, c.head_dim))
        keys, values = kv.read(index)
        out = grouped_attention(q, keys.to(self.dtype), values.to(self.dtype), kv.mask)
        return F.linear(out, layer.attn_output)
