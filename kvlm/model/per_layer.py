"""Per-layer inputs (PLE): besides its embedding, every token gets one small vector per layer.

Each vector mixes what the token is (a row of a second embedding table, n_layer x width values per token, times
sqrt(width)) with where it stands (the token's scaled embedding projected to the same size, times
1/sqrt(n_embd), RMS-normed per layer): their sum over sqrt(2). After its MLP, layer i adds
post_norm(proj(gelu(gate(x)) * vector_i)) to the residual stream.
"""
from __future__ import annotations

import torch

from kvlm.model.embedding import Embedding
from kvlm.model.linear import Linear


class PerLayerInputs:
    """The table and projection every layer's vector comes from, and the norms' parameters."""

    def __init__(self, config, table: Embedding, projection: Linear, projection_norm: torch.Tensor, ops,
                 dtype: torch.dtype) -> None:
        self.table, self.projection, self.projection_norm, self.ops = table, projection, projection_norm, ops
        self.width, self.n_layer, self.eps = config.per_layer_embd, config.n_layer, config.rms_norm_eps
        self.table_scale = torch.tensor(config.per_layer_embd ** 0.5).to(dtype)
        self.projection_scale = config.n_embd ** -0.5

    def __call__(self, tokens: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[n_tokens, n_layer, width]: every layer's vector for each token; `embedded`: the tokens' scaled
        embeddings."""
        identity = (self.table(tokens) * self.table_scale).view(-1, self.n_layer, self.width)
        context = (self.projection(embedded) * self.projection_scale).view(-1, self.n_layer, self.width)
        context = self.ops.norm(context.reshape(-1, self.width), self.projection_norm, self.eps).view(context.shape)
        return (context + identity) * 2 ** -0.5

    def add(self, layer, x: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        """x plus the layer's per-layer input term."""
        gated = self.ops.gelu_times(layer.gate(x), vector)
        return x + self.ops.norm(layer.proj(gated).contiguous(), layer.post_norm, self.eps)
