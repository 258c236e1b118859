"""For a micro-batch of decode tokens, `DecodeLayers` runs a whole attention layer as one native call
(kvlm.kernels.decode_layer), and a whole Gated DeltaNet layer as another (kvlm.kernels.delta_layer), where their
matrices are read natively: what the native CPU backend (kvlm.model.backend) offers the decoder for its decode
steps."""
from __future__ import annotations

import torch

from kvlm.kernels.decode_layer import DecodeStep, LayerShape, NativeDecodeLayer
from kvlm.kernels.delta_layer import NativeDeltaLayer
from kvlm.kernels.layer_ops import HEAD_DIM_STEP
from kvlm.kernels.native import NativeKernels
from kvlm.core.config import ModelConfig
from kvlm.memory.recurrent import LayerState
from kvlm.memory.view import KVView
from kvlm.model.layers import DeltaLayerWeights
from kvlm.model.linear import QuantizedLinear


class DecodeLayers:
    """The attention layers of a decoder whose matrices are quantized (read by the native kernels), each as one
    native call for a micro-batch of tokens that each read rows of their own (decode tokens, guesses), computing
    what the layer computes op by op, bit for bit. A layer of experts runs its attention so (up to its experts'
    input), its experts after. `run` returns None for anything else (prompt chunks, which op by op prefill about 10%
    faster; a compiled graph's view), and the decoder runs the layer op by op. Not for what the native call does not
    compute:
    a residual multiplier, a whole-projection QK-norm after Q/K/V biases, an output gate beside biases or a
    whole-projection QK-norm, experts beside the MLP. It computes Gemma 4's attention (each kind's head size and KV
    heads, V through a weightless norm, V taken from K, K/V read from another layer) and the per-layer input's term
    and output scale after the MLP; Qwen3.5's (the output gate, RoPE over part of each head).

    Gated DeltaNet layers likewise (`run_delta`), for micro-batches of one token per sequence: a Python step of such a
    layer is a dozen calls, each slower inside a step than alone (the products evict Python's working set)."""

    def __init__(self, kernels: NativeKernels, config: ModelConfig, layers: list, dtype: torch.dtype,
                 activation: str = "silu") -> None:
        gelu, eps = activation == "gelu_tanh", config.rms_norm_eps
        self.layers = {i: self._native(kernels, self._shape(config, i, layer, gelu), dtype, layer)
                       for i, layer in enumerate(layers) if self._computed(config, layer) and self._eligible(layer)}
        self.delta_layers = {
            i: NativeDeltaLayer(kernels, config.n_embd, 0 if layer.moe else config.ff_width(i), eps, gelu, dtype,
                                (layer.attn_norm, layer.ffn_norm), layer.mixer, self._delta_products(layer))
            for i, layer in enumerate(layers) if isinstance(layer, DeltaLayerWeights) and self._eligible(layer)}
        self._steps: list[tuple[KVView, torch.Tensor, DecodeStep]] = []  # of the forward pass under way

    @staticmethod
    def _shape(config: ModelConfig, index: int, layer, gelu: bool) -> LayerShape:
        spec = layer.spec
        n_kv = config.attention_geometry(config.layer_kinds[index])[0]  # what it reads: its own or another's
        computes_kv, queries = spec.n_kv > 0, spec.n_head * spec.head_dim * (2 if spec.output_gate else 1)
        return LayerShape(spec.n_head, n_kv, spec.head_dim, config.n_embd, 0 if layer.moe else config.ff_width(index),
                          config.rms_norm_eps, spec.scale, gelu, spec.whole_qk_norm, computes_kv,
                          computes_kv and layer.qkv.out_features == queries + n_kv * spec.head_dim,
                          spec.value_norm, config.per_layer_embd if layer.per_layer is not None else 0,
                          spec.output_gate, config.rope_dims)

    @staticmethod
    def _computed(config: ModelConfig, layer) -> bool:
        """Whether the native call computes what this attention layer computes (see the class)."""
        spec = getattr(layer, "spec", None)
        return (spec is not None and not (spec.whole_qk_norm and (layer.qkv_bias is not None or not spec.n_kv))
                and config.residual_multiplier == 1.0 and spec.head_dim % HEAD_DIM_STEP == 0
                and not (spec.output_gate and (layer.qkv_bias is not None or spec.whole_qk_norm
                                               or spec.head_dim > 512))
                and layer.beside_mlp is None
                and (layer.moe is None or (layer.per_layer is None and layer.output_scale is None)))

    @staticmethod
    def _matrices(layer) -> list:
        """The layer's matrices the native call multiplies (the attention's or mixer's alone in a layer of
        experts; a per-layer input's two)."""
        mixing = ("in_proj", "out_proj") if isinstance(layer, DeltaLayerWeights) else ("qkv", "attn_output")
        names = mixing if getattr(layer, "moe", None) is not None else (*mixing, "gate_up", "down")
        per_layer = getattr(layer, "per_layer", None)
        return [getattr(layer, name, None) for name in names] + ([] if per_layer is None else
                                                                  [per_layer.gate, per_layer.proj])

    @staticmethod
    def _delta_products(layer: DeltaLayerWeights) -> dict:
        products = {"in_proj": layer.in_proj.native, "out_proj": layer.out_proj.native}
        if layer.moe is None:
            products.update(gate_up=layer.gate_up.native, down=layer.down.native)
        return products

    @classmethod
    def _eligible(cls, layer) -> bool:
        return all(isinstance(m, QuantizedLinear) for m in cls._matrices(layer))

    @staticmethod
    def _native(kernels: NativeKernels, shape: LayerShape, dtype: torch.dtype, layer) -> NativeDecodeLayer:
        vectors = {name: getattr(layer, name) for name in ("attn_norm", "qkv_bias", "qk_norm", "post_attention_norm",
                                                           "ffn_norm", "post_ffw_norm", "output_bias", "sinks")}
        per_layer = layer.per_layer
        vectors.update(per_layer_norm=None if per_layer is None else per_layer.post_norm,
                       output_scale=layer.output_scale)
        vectors = {name: None if v is None else v.contiguous() for name, v in vectors.items()}
        products = {"qkv": layer.qkv.native, "output": layer.attn_output.native}
        if layer.moe is None:
            products.update(gate_up=layer.gate_up.native, down=layer.down.native)
        if per_layer is not None:
            products.update(per_layer_gate=per_layer.gate.native, per_layer_proj=per_layer.proj.native)
        return NativeDecodeLayer(kernels, shape, dtype, vectors, products)

    def run(self, index: int, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv,
            per_layer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Layer `index` for x [n_tokens, n_embd] natively: (x updated in place, None), or for a layer of experts
        (x after the attention, its experts' input); None where the layer must run op by op. `per_layer`: the
        tokens' per-layer input vectors for this layer [n_tokens, width], where the model has them."""
        native = self.layers.get(index)
        if native is None or torch.compiler.is_compiling() or x.dim() != 2:
            return None
        view, local = kv.layer_view(index)
        if not isinstance(view, KVView) or not view.per_token:  # prompt chunks: op by op, 10% faster (same bits)
            return None
        normed = torch.empty_like(x) if layer.moe is not None else None
        if per_layer is not None and (per_layer.dtype != x.dtype or per_layer.stride(-1) != 1):
            per_layer = per_layer.to(x.dtype).contiguous()
        return native(x.contiguous(), self._step(view, cos, sin), local, normed, per_layer), normed

    def run_delta(self, index: int, layer: DeltaLayerWeights, x: torch.Tensor,
                  state: LayerState) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Gated DeltaNet layer `index` for x [n_tokens, n_embd] natively, its states stepped in the memory's banks:
        (x updated in place, None), or for a layer of experts (x after the mixer, its experts' input); None where it
        must run op by op (prompt chunks: several tokens of a sequence)."""
        native = self.delta_layers.get(index)
        if native is None or torch.compiler.is_compiling() or x.dim() != 2 or state.shape[1] != 1:
            return None
        normed = torch.empty_like(x) if layer.moe is not None else None
        states = state.in_place()
        x = native(x.contiguous(), states, state.shape[1], normed)
        state.write(states)
        return x, normed

    def _step(self, view: KVView, cos: torch.Tensor, sin: torch.Tensor) -> DecodeStep:
        """The step's description for this view and RoPE, made once per forward pass (a few per pass: iSWA layers
        attend through two views, with two RoPEs)."""
        for seen_view, seen_cos, step in self._steps:
            if seen_view is view and seen_cos is cos:
                return step
        step = DecodeStep(cos.contiguous(), sin.contiguous(), view.rows.to(torch.int64).contiguous(),
                          view.token_cells, view.store)
        self._steps = [*self._steps[-3:], (view, cos, step)]
        return step
