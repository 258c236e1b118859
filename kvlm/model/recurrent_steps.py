"""The recurrent layers between their projections stepped token by token in torch: what a batch-invariant decoder
runs where kvlm's native recurrent kernels are missing (no compiler).

torch's chunked scans (kvlm.model.recurrent) give a token different bits inside a long prompt than alone; these
steps give it the same: each token of each sequence goes through one fixed sequence of operations, from the float32
state the token before left, a prompt as a run of decode steps. Every step computes in float64 and rounds once to
float32: torch may round a float32 value differently in a tensor's vectorized body and in its scalar tail (its
exp, its fused multiply-adds), which a float32 result would show and a rounded float64 one practically never does.
The same trade as the torch fallback's attention and activations (kvlm.model.backend.TorchBackend), at about the cost of
a decode step per prompt token: slow prompts, in a mode only machines without a compiler run.

The interface is NativeRecurrentOps' (kvlm.kernels.recurrent), which kvlm.model.recurrent's layers take as
`stepped`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvlm.model.recurrent import causal_conv, gated_rms_norm, l2_normalize, norm_then_gate

if TYPE_CHECKING:
    from kvlm.model.recurrent import DeltaNetWeights, Mamba2Weights

PRECISE = torch.float64


class SteppedRecurrentOps:
    steps_in_place = False  # takes gathered state tensors
    def causal_conv(self, x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    silu: bool = False, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """NativeRecurrentOps.causal_conv: x [n_seq, T, channels] after state [n_seq, channels, K-1]; returns
        out [n_seq, T, channels] (out_dtype, default x's) and the new state. Each output is its own K multiply-adds,
        whatever T is."""
        out, new_state = causal_conv(x.transpose(1, 2).to(PRECISE), state, weight.to(PRECISE), bias)
        out = out.transpose(1, 2)
        out = F.silu(out) if silu else out
        return out.to(out_dtype or x.dtype), new_state

    def mamba2_scan(self, w: Mamba2Weights, xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NativeRecurrentOps.mamba2_scan: xbc [n_seq, T, H*P + 2*G*N] after the convolution's SiLU, z and the raw
        dt from in_proj, state [n_seq, H, P, N]. Returns the gated norm's output [n_seq, T, H*P] in z's dtype and
        the new state (float32)."""
        bc_size = w.n_groups * w.d_state
        h, b, c = xbc.to(PRECISE).split([w.d_inner, bc_size, bc_size], dim=-1)
        h = h.unflatten(-1, (w.n_heads, w.head_dim))
        b, c = (t.unflatten(-1, (w.n_groups, w.d_state)).repeat_interleave(w.n_heads // w.n_groups, dim=2)
                for t in (b, c))
        dt = F.softplus(dt.to(PRECISE) + w.dt_bias.to(PRECISE)).clamp(*w.time_step_limit)
        decay = torch.exp(dt * -torch.exp(w.A_log.to(PRECISE)))  # [n, T, H]
        x = h * dt[..., None]
        ys = []
        for t in range(h.shape[1]):
            precise = state.to(PRECISE) * decay[:, t, :, None, None] + x[:, t, ..., None] * b[:, t, :, None, :]
            ys.append((precise * c[:, t, :, None, :]).sum(-1))
            state = precise.float()  # each token reads the float32 state a decode step would
        y = (torch.stack(ys, dim=1) + w.D.to(PRECISE)[:, None] * h).flatten(-2)
        return gated_rms_norm(y, z, w.norm, w.n_groups, w.eps, PRECISE).to(z.dtype), state

    def gated_delta_net(self, w: DeltaNetWeights, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                        a: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NativeRecurrentOps.gated_delta_net: mixed [n_seq, T, 2*Hk*Dk + Hv*Dv] after the convolution's SiLU,
        z, b and a from the projections, state [n_seq, Hv, Dk, Dv]. Returns the gated norm's output
        [n_seq, T, Hv*Dv] in z's dtype and the new state (float32)."""
        q, k, v = mixed.to(PRECISE).split([w.key_dim, w.key_dim, w.value_dim], dim=-1)
        q, k = (w.to_value_heads(l2_normalize(t.unflatten(-1, (w.n_k_heads, w.k_head_dim)))) for t in (q, k))
        q = q * w.k_head_dim ** -0.5
        v = v.unflatten(-1, (w.n_v_heads, w.v_head_dim))
        beta = torch.sigmoid(b.to(PRECISE))
        decay = torch.exp(w.A.to(PRECISE) * F.softplus(a.to(PRECISE) + w.dt_bias.to(PRECISE)))
        outs = []
        for t in range(q.shape[1]):
            out, state = _delta_step(q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], state)
            outs.append(out)
        y = norm_then_gate(torch.stack(outs, dim=1), z.unflatten(-1, (w.n_v_heads, w.v_head_dim)), w.norm, w.eps,
                            PRECISE)
        return y.flatten(-2).to(z.dtype), state


def _delta_step(q, k, v, decay, beta, state):
    """One token of the gated delta rule (kvlm.model.recurrent.delta_step) in float64 over the float32 state:
    q, k [n, H, Dk], v [n, H, Dv], decay and beta [n, H]. Products as sums of elementwise products, whose order per
    value does not depend on n (a batched matrix product's may). Returns o [n, H, Dv] and the new float32 state."""
    decay = decay[..., None]
    precise = state.to(PRECISE)
    k_read, q_read = ((t[..., None] * precise).sum(-2) for t in (k, q))  # S^T k, S^T q
    delta = (v - decay * k_read) * beta[..., None]
    out = decay * q_read + (k * q).sum(-1, keepdim=True) * delta
    precise = precise * decay[..., None] + k[..., None] * delta[..., None, :]
    return out, precise.float()
