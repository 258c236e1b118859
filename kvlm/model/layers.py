"""What each kind of layer holds once its weights are read (kvlm.model.build), and what its attention computes:
the records the blocks (kvlm.model.blocks) run."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.model.linear import Linear
from kvlm.model.moe import MoEWeights
from kvlm.model.recurrent import DeltaNetWeights, Mamba2Weights, ShortConvWeights


@dataclass(frozen=True)
class AttentionSpec:
    """What an attention layer computes beside its tensors, decided once from the model's config and family."""

    n_head: int
    n_kv: int  # the KV heads it computes; 0 for a layer that reads another layer's K/V
    head_dim: int
    scale: float  # Q is multiplied by it: scores are q.k x scale / sqrt(head_dim)
    output_gate: bool = False  # the Q projection gives each head its query then as many gate values
    whole_qk_norm: bool = False  # QK-norm over each token's whole Q projection and whole K one, not per head
    value_norm: bool = False  # V heads through a weightless RMSNorm


@dataclass
class LayerWeights:
    """An attention layer: its attention's weights, then its MLP's (or experts'), and the optional parts its
    tensors give it."""

    attn_norm: torch.Tensor
    qkv: Linear             # Q, K and V projections stacked: one matmul instead of three
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [n_head + n_head_kv, head_dim]: each Q head's then each K head's weight
    attn_output: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None  # gate and up projections stacked (None in a layer of experts)
    down: Linear | None
    spec: AttentionSpec  # what its attention computes
    post_attention_norm: torch.Tensor | None = None  # sandwich norms: on each output, before its add
    post_ffw_norm: torch.Tensor | None = None
    moe: MoEWeights | None = None  # experts in place of the MLP
    output_bias: torch.Tensor | None = None  # the attention output projection's bias
    sinks: torch.Tensor | None = None  # [n_head] float32: attention sinks' logits
    beside_mlp: ExpertsBesideMLP | None = None  # experts beside the MLP (`moe`), with their own norms
    per_layer: PerLayerInput | None = None  # the layer's per-layer input (PLE)
    output_scale: torch.Tensor | None = None  # the layer's output times it


@dataclass
class ExpertsBesideMLP:
    """The norms around experts that run beside the MLP: the experts read pre_norm(x), the MLP's and the
    experts' outputs are normed apart (mlp_norm, experts_norm) and added."""

    pre_norm: torch.Tensor
    mlp_norm: torch.Tensor
    experts_norm: torch.Tensor


@dataclass
class PerLayerInput:
    """A per-layer input: x + post_norm(proj(gelu(gate(x)) * the layer's per-layer vector))."""

    gate: Linear
    proj: Linear
    post_norm: torch.Tensor


@dataclass
class ConvLayerWeights:
    """A short-convolution layer: its norm, the gated convolution, then the same MLP as attention layers."""

    attn_norm: torch.Tensor
    conv: ShortConvWeights
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class MambaLayerWeights:
    """A Mamba2 mixer layer: a norm, then the mixer, added to the residual stream (no MLP)."""

    attn_norm: torch.Tensor
    mixer: Mamba2Weights


@dataclass
class DeltaLayerWeights:
    """A Gated DeltaNet layer: its norm; the mixer's input projections (Q/K/V, the output gate z, beta's and
    the decay's) stacked in one matrix, split by `in_sizes`; the delta rule's own weights and the output projection;
    then the MLP, or experts, as an attention layer's."""

    attn_norm: torch.Tensor
    in_proj: Linear
    in_sizes: tuple[int, int, int, int]
    mixer: DeltaNetWeights
    out_proj: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None
    down: Linear | None
    moe: MoEWeights | None = None
