"""A layer's small ops, each one native call where the kernels are built (kvlm.kernels.layer_ops), torch's ops
(kvlm.model.ops) otherwise: in the reference mode, without a compiler, and while torch.compile traces a graph (it
cannot trace a ctypes call). For a micro-batch of decode tokens, `DecodeLayers` runs a whole attention layer as
one native call (kvlm.kernels.decode_layer) where its matrices are read natively.

At batch 1 a small model's step is mostly such ops: an RMSNorm in bfloat16 is eight eager torch ops, RoPE five, the
gated activation three. The native ones compute in float32 and round once at the end, where torch rounds after
each step, so their results differ from torch's by at most a rounding of the activation dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlm.kernels.decode_layer import DecodeStep, LayerShape, NativeDecodeLayer
from kvlm.kernels.layer_ops import HEAD_DIM_STEP, NativeLayerOps
from kvlm.kernels.native import NativeKernels
from kvlm.core.config import ModelConfig
from kvlm.memory.view import KVView
from kvlm.model.linear import QuantizedLinear
from kvlm.core.rope import apply_rope
from kvlm.model.ops import rms_norm
from kvlm.model.recurrent import delta_step

ACTIVATIONS = ("silu", "gelu_tanh")


class LayerOps:
    """`batch_invariant`: where torch's ops run instead (no native kernels), their transcendental functions (the
    activations, sigmoid, tanh) run in float64 and round once: torch rounds a value differently in a tensor's
    vectorized body and in its scalar tail, which a float32 result would show and a rounded float64 one
    practically never does."""

    def __init__(self, native: NativeLayerOps | None, batch_invariant: bool = False) -> None:
        self.native = native
        self.precise = torch.float64 if batch_invariant else None

    def _use_native(self) -> bool:
        return self.native is not None and not torch.compiler.is_compiling()

    def attention_kernel(self) -> NativeLayerOps | None:
        """What decode attention may call natively (None: torch's attention)."""
        return self.native if self._use_native() else None

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._use_native() and x.dim() == 2 and x.is_contiguous():
            return self.native.rms_norm(x, weight, eps)[0]
        return rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + h) * weight, x + h): the residual add and the next norm in one pass."""
        if self._use_native() and x.dim() == 2 and x.is_contiguous() and h.is_contiguous():
            return self.native.rms_norm(x, weight, eps, residual=h)
        x = x + h
        return rms_norm(x, weight, eps), x

    def head_norm(self, qk: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of qk [T, heads, d], head h times weight[h] (QK-norm); in place where
        native."""
        if self._use_native() and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]:
            return self.native.head_norm_(qk, weight, eps)
        return F.rms_norm(qk, (qk.shape[-1],), eps=eps) * weight

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [T, heads, d] rotated by float32 cos, sin [T, 1, d] (in place where native)."""
        if self._use_native() and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2] and cos.shape[-1] == qk.shape[2]:
            return self.native.rope_(qk, cos, sin)
        return apply_rope(qk, cos.to(qk.dtype), sin.to(qk.dtype))

    def gated_mlp(self, x: torch.Tensor, gate_up, down, activation: str = "silu") -> torch.Tensor:
        """down(act(gate(x)) * up(x)): SwiGLU with "silu", GeGLU with "gelu_tanh"; gate and up stacked in one."""
        both = gate_up(x)
        if self._use_native() and both.is_contiguous():
            return down(self.native.gated(both, activation == "gelu_tanh"))
        gate, up = both.chunk(2, dim=-1)
        return down(self._torch(lambda g: F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh"),
                                gate) * up)

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate), gate [rows, n] like x [rows, n] or [rows, 1] for each row (Qwen3.5's output gate,
        Qwen2-MoE's shared expert's)."""
        if self._use_native() and x.dim() == 2 and x.is_contiguous():
            return self.native.sigmoid_gate(x, gate)
        return x * self._torch(torch.sigmoid, gate).to(x.dtype)

    def gelu_times(self, gate: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * vector (tanh approximation; Gemma 4's per-layer inputs): the gated activation over the two
        side by side."""
        if self._use_native() and gate.dim() == 2:
            return self.native.gated(torch.cat([gate, vector.to(gate.dtype)], dim=-1), True)
        return self._torch(lambda g: F.gelu(g, approximate="tanh"), gate) * vector

    def softcap(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        """cap * tanh(logits / cap) for float32 logits [rows, n] (Gemma's final softcap)."""
        if self._use_native() and logits.dim() == 2 and logits.is_contiguous():
            return self.native.softcap_(logits, cap)
        return cap * self._torch(torch.tanh, logits / cap)

    def _torch(self, function, x: torch.Tensor) -> torch.Tensor:
        """torch's `function` of x, in x's dtype: through float64 where batch-invariant (see the class)."""
        return function(x) if self.precise is None else function(x.to(self.precise)).to(x.dtype)

    def delta_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule for one token (recurrent.delta_step): (out [n, 1, H, Dv], new state); the state
        passed in is left as it was."""
        if self._use_native():
            return self.native.delta_step(q, k, v, g, beta, state)
        return delta_step(q, k, v, g, beta, state)


class DecodeLayers:
    """The attention layers of a decoder whose matrices are quantized (read by the native kernels), each as one
    native call for a micro-batch of tokens that each read rows of their own (decode tokens, guesses), computing
    what the layer computes op by op, bit for bit. A layer of experts runs its attention so (up to its experts'
    input), its experts after. `run` returns None for anything else (prompt chunks, which op by op prefill about 10%
    faster; a compiled graph's view), and the decoder runs the layer op by op. Not for what the native call does not
    compute:
    Granite's residual multiplier, a whole-projection QK-norm after Q/K/V biases, Qwen3.5's output gate, RoPE over
    part of each head, Gemma 4's attention."""

    def __init__(self, kernels: NativeKernels, config: ModelConfig, layers: list, dtype: torch.dtype) -> None:
        family = config.family
        shapes = [LayerShape(config.n_head, config.n_head_kv, config.head_dim, config.n_embd, 0 if moe else config.n_ff,
                             config.rms_norm_eps, config.query_scale, family.activation == "gelu_tanh",
                             family.qk_norm_whole)
                  for moe in config.moe_layers]
        computed = (not (family.qk_norm_whole and family.qkv_bias) and config.residual_multiplier == 1.0
                    and not family.attention_output_gate and config.rotary_dims == config.head_dim
                    and not family.value_norm)  # Gemma 4's V norm, unscaled scores, per-kind heads, shared K/V
        self.layers = {i: self._native(kernels, shapes[i], dtype, layer) for i, layer in enumerate(layers)
                       if computed and self._eligible(layer) and config.head_dim % HEAD_DIM_STEP == 0}
        self._steps: list[tuple[KVView, torch.Tensor, DecodeStep]] = []  # of the forward pass under way

    @staticmethod
    def _matrices(layer) -> list:
        """The layer's matrices the native call multiplies (the attention's alone in a layer of experts)."""
        names = ("qkv", "attn_output") if getattr(layer, "moe", None) is not None else ("qkv", "attn_output",
                                                                                      "gate_up", "down")
        return [getattr(layer, name, None) for name in names]

    @classmethod
    def _eligible(cls, layer) -> bool:
        return all(isinstance(m, QuantizedLinear) for m in cls._matrices(layer))

    @staticmethod
    def _native(kernels: NativeKernels, shape: LayerShape, dtype: torch.dtype, layer) -> NativeDecodeLayer:
        vectors = {name: getattr(layer, name) for name in ("attn_norm", "qkv_bias", "qk_norm", "post_attention_norm",
                                                           "ffn_norm", "post_ffw_norm", "output_bias", "sinks")}
        vectors = {name: None if v is None else v.contiguous() for name, v in vectors.items()}
        products = {"qkv": layer.qkv.native, "output": layer.attn_output.native}
        if layer.moe is None:
            products.update(gate_up=layer.gate_up.native, down=layer.down.native)
        return NativeDecodeLayer(kernels, shape, dtype, vectors, products)

    def run(self, index: int, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Layer `index` for x [n_tokens, n_embd] natively: (x updated in place, None), or for a layer of experts
        (x after the attention, its experts' input); None where the layer must run op by op."""
        native = self.layers.get(index)
        if native is None or torch.compiler.is_compiling() or x.dim() != 2:
            return None
        view, local = kv.layer_view(index)
        if not isinstance(view, KVView) or not view.per_token:  # prompt chunks: op by op, 10% faster (same bits)
            return None
        normed = torch.empty_like(x) if layer.moe is not None else None
        return native(x.contiguous(), self._step(view, cos, sin), local, normed), normed

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
