"""What each kind of layer computes, over the decoder's ops (kvlm.model.backend), its settings and its tensor-parallel
hook: a pre-norm attention block (sandwich norms, an output bias, experts instead of or beside the MLP where the
layer has them), a short-convolution block, a Gated DeltaNet block and a Mamba2 block. The decoder is one of these:
it walks its layers through `blocks_by_kind()`."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvlm.core.family import ATTENTION, CONV, GATED_DELTA, MAMBA, SLIDING
from kvlm.memory.recurrent import LayerState
from kvlm.memory.view import MemoryView
from kvlm.model.attention import attend_layer
from kvlm.model.layers import (
    AttentionSpec,
    ConvLayerWeights,
    DeltaLayerWeights,
    LayerWeights,
    MambaLayerWeights,
)
from kvlm.model.recurrent import gated_delta_net, mamba2_mixer, short_conv


class Blocks:
    """The blocks of a decoder: it sets `config`, `ops` (its backend), `activation` (the gated MLP's), `dtype`,
    `batch_invariant`, `per_layer_inputs` (kvlm.model.per_layer, or None), `decode_layers` (whole layers natively for
    decode steps, or None), `_recurrent` (stepped recurrent layers, or None) and `all_reduce` (tensor parallelism's sum
    over ranks, or None)."""

    all_reduce: Callable[[torch.Tensor], object] | None = None

    def blocks_by_kind(self) -> dict:
        """The block each layer kind runs: (index, layer, x, cos, sin, kv) -> x."""
        return {ATTENTION: self._attention_block, SLIDING: self._attention_block, CONV: self._conv_block,
                MAMBA: self._mamba_block, GATED_DELTA: self._delta_block}

    def _whole_qk_norm(self, qk: torch.Tensor, weight: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        """RMSNorm over each token's whole Q projection, and over its whole K projection."""
        eps, n_tokens, q_size = self.config.rms_norm_eps, qk.shape[0], spec.n_head * spec.head_dim
        q, k = qk.reshape(n_tokens, -1).split((q_size, spec.n_kv * spec.head_dim), dim=-1)
        q = self.ops.norm(q.contiguous(), weight[:q_size], eps)
        k = self.ops.norm(k.contiguous(), weight[q_size:], eps)
        return torch.cat([q, k], dim=-1).view(qk.shape)

    def _ones(self, n: int, device: torch.device) -> torch.Tensor:
        """The weight of a weightless RMSNorm (a V norm), for the ops' norm."""
        return torch.ones(n, dtype=self.dtype, device=device)

    def _attention_block(self, index: int, layer: LayerWeights, x, cos, sin, kv: MemoryView,
                         per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-norm attention then a pre-norm gated MLP, each added to the residual stream (each output normed
        once more first where the layer has sandwich norms), then the per-layer input's term (`per_layer`: the
        tokens' vectors for this layer) and the output scale where the layer has them; one native call for decode
        tokens where it can be."""
        activation = self.activation
        if self.decode_layers is not None and self.all_reduce is None:
            done = self.decode_layers.run(index, layer, x, cos, sin, kv, per_layer)
            if done is not None:
                x, experts_input = done
                return x if experts_input is None else x + layer.moe(experts_input, self.ops, activation)
        eps, ops, residual = self.config.rms_norm_eps, self.ops, self.config.residual_multiplier
        h = self._summed(self._attention(index, layer, ops.norm(x, layer.attn_norm, eps), cos, sin, kv))
        if layer.output_bias is not None:  # after the ranks' partial sums are added up: once
            h = h + layer.output_bias
        if layer.post_attention_norm is not None:
            h = ops.norm(h, layer.post_attention_norm, eps)
        normed, x = ops.add_norm(x, h if residual == 1.0 else h * residual, layer.ffn_norm, eps)
        h = self._mlp(layer, normed) if layer.beside_mlp is None else self._mlp_and_experts(layer, normed, x)
        h = h if layer.post_ffw_norm is None else ops.norm(h, layer.post_ffw_norm, eps)
        x = x + (h if residual == 1.0 else h * residual)
        if per_layer is not None:
            x = self.per_layer_inputs.add(layer.per_layer, x, per_layer)
        return x if layer.output_scale is None else x * layer.output_scale

    def _mlp(self, layer: LayerWeights | DeltaLayerWeights, normed: torch.Tensor) -> torch.Tensor:
        """The layer's gated MLP, or its experts, summed over the tensor-parallel ranks."""
        activation = self.activation
        return self._summed(layer.moe(normed, self.ops, activation) if layer.moe is not None else
                            self.ops.gated_mlp(normed, layer.gate_up, layer.down, activation))

    def _mlp_and_experts(self, layer: LayerWeights, normed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """An MLP (on `normed`) and experts beside it (on their own norm of the residual stream x, routed from x
        itself), each output normed, then added."""
        eps, ops, activation, norms = self.config.rms_norm_eps, self.ops, self.activation, layer.beside_mlp
        mlp = ops.norm(ops.gated_mlp(normed, layer.gate_up, layer.down, activation), norms.mlp_norm, eps)
        experts = layer.moe(ops.norm(x, norms.pre_norm, eps), ops, activation, router_input=x)
        return mlp + ops.norm(experts, norms.experts_norm, eps)

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's partial sum, added up over the tensor-parallel ranks (if any)."""
        if self.all_reduce is not None:
            self.all_reduce(partial)
        return partial

    def _conv_block(self, index: int, layer: ConvLayerWeights, x, cos, sin, kv) -> torch.Tensor:
        """The gated short convolution over each sequence's tokens (the micro-batch holds them as [n_seqs,
        n_tokens], see kvlm.memory.recurrent), from and to the sequence's state; then the MLP."""
        eps = self.config.rms_norm_eps
        state = kv.recurrent(index)
        h = self.ops.norm(x, layer.attn_norm, eps).view(*state.shape, -1)
        y, conv_state = short_conv(layer.conv, h, *self._states(state), stepped=self._recurrent)
        state.write([conv_state])
        normed, x = self.ops.add_norm(x, y.reshape(x.shape), layer.ffn_norm, eps)
        return x + self.ops.gated_mlp(normed, layer.gate_up, layer.down, self.activation)

    def _delta_block(self, index: int, layer: DeltaLayerWeights, x, cos, sin, kv) -> torch.Tensor:
        """Gated DeltaNet linear attention over each sequence's tokens (as [n_seqs, n_tokens], see _conv_block) from and
        to its convolution and delta-rule states; then the MLP. One native call for decode tokens where it can be."""
        eps, state = self.config.rms_norm_eps, kv.recurrent(index)
        if self.decode_layers is not None and self.all_reduce is None:
            done = self.decode_layers.run_delta(index, layer, x, state)
            if done is not None:
                x, experts_input = done
                return x if experts_input is None else x + layer.moe(experts_input, self.ops, self.activation)
        projected = layer.in_proj(self.ops.norm(x, layer.attn_norm, eps)).view(*state.shape, -1)
        y, conv_state, delta_state = gated_delta_net(layer.mixer, *projected.split(layer.in_sizes, dim=-1),
                                                     *self._states(state), step=self.ops.delta_step,
                                                     stepped=self._recurrent)
        state.write([conv_state, delta_state])
        normed, x = self.ops.add_norm(x, layer.out_proj(y.reshape(x.shape[0], -1)), layer.ffn_norm, eps)
        return x + self._mlp(layer, normed)

    def _mamba_block(self, index: int, layer: MambaLayerWeights, x, cos, sin, kv) -> torch.Tensor:
        state = kv.recurrent(index)
        h = self.ops.norm(x, layer.attn_norm, self.config.rms_norm_eps).view(*state.shape, -1)
        y, conv_state, ssm_state = mamba2_mixer(layer.mixer, h, *self._states(state), stepped=self._recurrent)
        state.write([conv_state, ssm_state])
        return x + y.reshape(x.shape)

    def _states(self, state: LayerState) -> list:
        """A recurrent layer's states as its ops take them: where the memory keeps them for ops that step them in
        place (the native kernels: nothing gathered or copied back), else gathered into tensors."""
        in_place = self._recurrent is not None and self._recurrent.steps_in_place
        return state.in_place() if in_place else state.read()

    def _attention(self, index: int, layer: LayerWeights, h, cos, sin, kv: MemoryView) -> torch.Tensor:
        spec, eps = layer.spec, self.config.rms_norm_eps
        n_head, n_kv, head_dim = spec.n_head, spec.n_kv, spec.head_dim  # n_kv 0: Q alone, reading another's K/V
        q_size, kv_size = n_head * head_dim, n_kv * head_dim
        n_tokens = h.shape[0]
        qkv = layer.qkv(h)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        gate = None
        if spec.output_gate:  # each head's query, then its gate: Q and K heads put side by side
            q_gate, k, v = qkv.split((2 * q_size, kv_size, kv_size), dim=-1)
            q, gate = q_gate.view(n_tokens, n_head, 2, head_dim).unbind(2)
            qk = torch.cat([q, k.view(n_tokens, n_kv, head_dim)], dim=1)
        else:
            qk, v = qkv[:, :q_size + kv_size], qkv[:, q_size + kv_size:]
        if n_kv and v.shape[-1] == 0:  # V = K as projected (a layer without a V projection)
            v = qk[:, q_size:]
        v = v.view(n_tokens, n_kv, head_dim) if n_kv else None
        if v is not None and spec.value_norm:  # before the QK-norm, which may run in place on K
            v = self.ops.norm(v.reshape(-1, head_dim).contiguous(), self._ones(head_dim, v.device), eps).view(v.shape)
        # Q and K heads side by side take their norm and rotation in one go.
        qk = qk.view(n_tokens, n_head + n_kv, head_dim)
        if layer.qk_norm is not None and spec.whole_qk_norm:  # over each token's whole Q, then whole K
            qk = self._whole_qk_norm(qk, layer.qk_norm, spec)
        elif layer.qk_norm is not None:
            qk = self.ops.head_norm(qk, layer.qk_norm, eps)
        q, k = self.ops.rope(qk, cos, sin).split((n_head, n_kv), dim=1)
        if spec.scale != 1.0:
            q = q * spec.scale
        out = attend_layer(kv, index, q, k if n_kv else None, v, self.batch_invariant, self.ops.attention_kernel(),
                           layer.sinks)
        if gate is not None:
            out = self.ops.sigmoid_gate(out, gate.reshape(n_tokens, -1))
        return layer.attn_output(out)
