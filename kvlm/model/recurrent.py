"""The math of recurrent layers as plain functions over explicit states: a gated short convolution, Mamba2's mixer
and the gated delta rule ("Gated DeltaNet").

Each function takes T new tokens of each of n_seq sequences ([n_seq, T, ...]), with each sequence's state
before them (zeros for a fresh sequence), and returns the output and the states after them. Feeding a sequence
in pieces, each piece continuing from the states the previous one returned, gives what feeding it whole gives.
Projections run in x's dtype, the scans and their states in float32. They match transformers' modules for the
short convolution, the Mamba2 mixer and the gated delta net (whose projections the caller does: gated_delta_net
takes their outputs).

Given `stepped` (kvlm.kernels.recurrent's native ops, or kvlm.model.recurrent_steps' torch ones where those cannot
be built), everything between the projections steps every token in order with one fixed sequence of float
operations, a prompt as a run of decode steps: a token's output then has the same bits however its sequence was cut
into calls and whatever shares the call. Without it (the reference mode), torch runs prompts through chunked
algorithms and single tokens through the recurrence, which agree only up to float rounding.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvlm.kernels.recurrent import NativeRecurrentOps
    from kvlm.model.recurrent_steps import SteppedRecurrentOps

    RecurrentSteps = NativeRecurrentOps | SteppedRecurrentOps

# A projection: a weight [out, in] for F.linear, or a kvlm Linear (e.g. native products over a GGUF's blocks)
# taking [rows, in] to [rows, out].
Projection = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]

# Tokens per block of the chunked scan: its work within a block grows with the block's length, the Python
# steps between blocks with their number. 32 and 64 were fastest on one CPU core for prompts of hundreds of
# tokens; 256, transformers' default, took 1.5-4x as long.
SCAN_CHUNK = 64
# The same trade-off for the gated delta rule's blocks, whose triangular solve also grows with their length:
# with 16-32 heads of 128 x 128 and a few hundred tokens, 64 took 10-25% less time than 32 or 128.
DELTA_CHUNK = 64


@dataclass
class ShortConvWeights:
    in_proj: Projection  # [3*d, d]: the rows of B, then C, then x
    conv: torch.Tensor  # [d, L]: one causal filter per channel
    out_proj: Projection  # [d, d]
    in_proj_bias: torch.Tensor | None = None
    conv_bias: torch.Tensor | None = None
    out_proj_bias: torch.Tensor | None = None


def _project(proj: Projection, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] through a projection (a weight or a kvlm Linear), plus its bias if any: [..., out]."""
    if isinstance(proj, torch.Tensor):
        return F.linear(x, proj, bias)
    y = proj(x.reshape(-1, x.shape[-1])).unflatten(0, x.shape[:-1])
    return y if bias is None else y + bias


def short_conv(w: ShortConvWeights, x: torch.Tensor, conv_state: torch.Tensor,
               stepped: RecurrentSteps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated short convolution: out_proj(C * conv(B * x)).

    conv_state [n_seq, d, L-1] holds the last L-1 inputs of the convolution. Returns y [n_seq, T, d] and the
    new conv_state. The gates are products, whose bits torch computes the same anywhere: only the convolution
    differs with `stepped`.
    """
    b, c, h = _project(w.in_proj, x, w.in_proj_bias).chunk(3, dim=-1)
    if stepped is None:
        conv_out, conv_state = causal_conv((b * h).transpose(1, 2), conv_state, w.conv, w.conv_bias)
        conv_out = conv_out.transpose(1, 2)
    else:
        conv_out, conv_state = stepped.causal_conv(b * h, conv_state, w.conv, w.conv_bias)
    return _project(w.out_proj, c * conv_out, w.out_proj_bias), conv_state


def causal_conv(u: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of u [n_seq, channels, T] by weight [channels, K] after the K-1 inputs in
    state [n_seq, channels, K-1]. Returns the T outputs (in u's dtype) and the last K-1 inputs (in state's)."""
    inputs = torch.cat([state.to(u.dtype), u], dim=-1)
    n_tokens, taps = u.shape[-1], inputs.to(weight.dtype)
    # One multiply-add per filter tap: torch's grouped conv1d (oneDNN) took ~0.3 ms for one token of 6144 channels,
    # these K passes over [n_seq, channels, T] a few microseconds
    out = taps[..., :n_tokens] * weight[:, :1]
    for k in range(1, weight.shape[1]):
        out.addcmul_(taps[..., k:k + n_tokens], weight[:, k:k + 1])
    if bias is not None:
        out += bias[:, None]
    return out.to(u.dtype), inputs[..., n_tokens:].to(state.dtype)


@dataclass
class Mamba2Weights:
    in_proj: Projection  # [2*d_inner + 2*G*N + H, d_model]: the rows of z, then x, B, C (the conv's input), dt
    conv: torch.Tensor  # [conv_dim, K], conv_dim = d_inner + 2*G*N
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor  # [H]
    A_log: torch.Tensor  # [H]: A = -exp(A_log)
    D: torch.Tensor  # [H]
    norm: torch.Tensor  # [d_inner]
    out_proj: Projection  # [d_model, d_inner]
    n_heads: int  # H
    head_dim: int  # P
    d_state: int  # N
    n_groups: int  # G: head h reads the B and C of group h // (H / G)
    eps: float  # of the gated RMS norm
    in_proj_bias: torch.Tensor | None = None
    out_proj_bias: torch.Tensor | None = None
    # dt is clamped to it for every token; transformers skips the clamp in its cached single-token step only.
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        # mamba_ssm's optional MLP branch (d_mlp > 0) would add rows before z; transformers splits in_proj
        # into exactly z, xBC and dt and has no such branch, so neither do we. (A Linear's rows are its own.)
        rows = self.d_inner + self.conv_dim + self.n_heads
        if isinstance(self.in_proj, torch.Tensor) and self.in_proj.shape[0] != rows:
            raise ValueError(f"Mamba2 in_proj has {self.in_proj.shape[0]} rows, expected {rows} "
                             f"(z, xBC, dt; no MLP branch)")
        if self.n_heads % self.n_groups:
            raise ValueError(f"Mamba2 n_heads {self.n_heads} is not a multiple of n_groups {self.n_groups}")

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def conv_kernel(self) -> int:
        return self.conv.shape[1]


def mamba2_mixer(w: Mamba2Weights, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                 stepped: RecurrentSteps | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mamba2's mixer: in_proj, causal conv + SiLU, selective scan with D skip, gated RMS norm, out_proj.

    conv_state [n_seq, conv_dim, K-1] holds the last K-1 inputs of the convolution; ssm_state [n_seq, H, P, N]
    the scan's state (float32). Returns y [n_seq, T, d_model] and both new states.
    """
    z, xbc, dt = _project(w.in_proj, x, w.in_proj_bias).split([w.d_inner, w.conv_dim, w.n_heads], dim=-1)
    if stepped is not None:
        xbc, conv_state = stepped.causal_conv(xbc, conv_state, w.conv, w.conv_bias, silu=True,
                                             out_dtype=torch.float32)
        y, ssm_state = stepped.mamba2_scan(w, xbc, z, dt, ssm_state)
        return _project(w.out_proj, y, w.out_proj_bias), conv_state, ssm_state
    xbc, conv_state = causal_conv(xbc.transpose(1, 2), conv_state, w.conv, w.conv_bias)
    bc_size = w.n_groups * w.d_state
    h, b, c = F.silu(xbc).transpose(1, 2).float().split([w.d_inner, bc_size, bc_size], dim=-1)
    h = h.unflatten(-1, (w.n_heads, w.head_dim))
    b, c = (t.unflatten(-1, (w.n_groups, w.d_state)) for t in (b, c))
    dt = F.softplus(dt.float() + w.dt_bias.float()).clamp(*w.time_step_limit)
    y, ssm_state = ssd_scan(h, dt, -torch.exp(w.A_log.float()), b, c, ssm_state.float())
    y = (y + w.D.float()[:, None] * h).flatten(-2)
    y = gated_rms_norm(y, z, w.norm, w.n_groups, w.eps)
    return _project(w.out_proj, y.to(x.dtype), w.out_proj_bias), conv_state, ssm_state


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T, y_t = s_t C_t, from s_0 = state.

    x [n, T, H, P], dt [n, T, H], A [H], B and C [n, T, G, N], state [n, H, P, N]. Runs SCAN_CHUNK tokens at a
    time (the SSD form): memory is linear in T, never quadratic. Returns y [n, T, H, P] and s_T.
    """
    n_heads = x.shape[2]
    B, C = (t.repeat_interleave(n_heads // t.shape[2], dim=2) for t in (B, C))
    if x.shape[1] == 1:  # decode: the recurrence itself is several times cheaper than a block of one token
        return _ssm_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state)
    ys = []
    for start in range(0, x.shape[1], SCAN_CHUNK):
        block = slice(start, start + SCAN_CHUNK)
        y, state = _ssd_block(x[:, block], dt[:, block], A, B[:, block], C[:, block], state)
        ys.append(y)
    return torch.cat(ys, dim=1), state


def _ssm_step(x, dt, A, B, C, state):
    """ssd_scan for one token, B and C already per head: x [n, H, P], dt [n, H], B and C [n, H, N]."""
    x = x * dt[..., None]
    state = (state * torch.exp(dt * A)[..., None, None]).addcmul_(x[..., None], B[:, :, None, :])
    # A product and a sum: on CPU, batched matrix-vector products (state @ C) take several times longer.
    return (state * C[:, :, None, :]).sum(-1)[:, None], state


def _ssd_block(x, dt, A, B, C, state):
    """ssd_scan over one block of l tokens, B and C already per head: the outputs from inside the block are an
    l x l decay-weighted product, like causal attention; those from before it come through the state."""
    x, B, C = (t.transpose(1, 2) for t in (x, B, C))  # heads first: [n, H, l, P or N]
    dt = dt.transpose(1, 2)  # [n, H, l]
    x = x * dt[..., None]
    step_decay = dt * A[:, None]  # the log of each step's decay
    log_decay = step_decay.cumsum(-1)  # from the block's start through each step
    y = (C @ B.transpose(-1, -2) * torch.exp(_segment_sums(step_decay))) @ x
    y = y + (C @ state.transpose(-1, -2)) * torch.exp(log_decay)[..., None]
    to_end = torch.exp(log_decay[..., -1:] - log_decay)  # from each step to the block's end
    state = state * torch.exp(log_decay[..., -1])[..., None, None] + (x * to_end[..., None]).transpose(-1, -2) @ B
    return y.transpose(1, 2), state


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., l] -> [..., l, l]: a[s+1] + ... + a[t] at (t, s) for s <= t, -inf above the diagonal.

    Summed term by term, as transformers' segment_sum: a difference of cumulative sums loses precision once
    those are large."""
    n = a.shape[-1]
    ones = torch.ones(n, n, dtype=torch.bool, device=a.device)
    sums = a[..., None].expand(*a.shape, n).masked_fill(~ones.tril(-1), 0).cumsum(-2)
    return sums.masked_fill(ones.triu(1), -math.inf)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_groups: int,
                   eps: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' MambaRMSNormGated: y * silu(z), RMS-normalized within each of n_groups equal slices of the
    last dim, times weight; in float32 (or `dtype`)."""
    g = (y.to(dtype) * F.silu(z.to(dtype))).unflatten(-1, (n_groups, -1))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.flatten(-2)


@dataclass
class DeltaNetWeights:
    """What a Gated DeltaNet layer needs besides its projections (in_proj_qkv, _z, _b, _a, out_proj)."""
    conv: torch.Tensor  # [conv_dim, K]: depthwise causal filter over the q, k, v channels (no bias)
    dt_bias: torch.Tensor  # [Hv]
    A: torch.Tensor  # [Hv] float32: A = -exp(A_log), as GGUF files store it (ssm_a)
    norm: torch.Tensor  # [Dv]: the gated RMS norm's weight, shared by all value heads (no +1 offset)
    n_k_heads: int  # Hk
    n_v_heads: int  # Hv, a multiple of Hk
    k_head_dim: int  # Dk
    v_head_dim: int  # Dv
    eps: float  # of the gated RMS norm
    # Which key head each value head reads. Hugging Face groups the value heads by key head (v head j reads k
    # head j // (Hv/Hk)); llama.cpp's GGUF converter reorders them so that v head j reads k head j % Hk.
    v_heads_tiled: bool = False

    def __post_init__(self) -> None:
        if self.n_v_heads % self.n_k_heads:
            raise ValueError(f"DeltaNet n_v_heads {self.n_v_heads} is not a multiple of n_k_heads {self.n_k_heads}")
        if self.conv.shape[0] != self.conv_dim:
            raise ValueError(f"DeltaNet conv has {self.conv.shape[0]} channels, expected {self.conv_dim} "
                             f"(q, k: {self.n_k_heads} x {self.k_head_dim}; v: {self.n_v_heads} x {self.v_head_dim})")

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def to_value_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[n, T, Hk, Dk] -> [n, T, Hv, Dk]: each value head's key (or query) head."""
        per_k_head = self.n_v_heads // self.n_k_heads
        if per_k_head == 1:
            return t
        if self.v_heads_tiled:
            return t.repeat(1, 1, per_k_head, 1)
        return t.repeat_interleave(per_k_head, dim=2)


def gated_delta_net(w: DeltaNetWeights, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    conv_state: torch.Tensor, state: torch.Tensor, step=None,
                    stepped: RecurrentSteps | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet linear attention between its projections: causal conv + SiLU, the gated delta rule, gated RMS norm.

    qkv [n_seq, T, conv_dim] (in_proj_qkv's output: the rows of q, then k, then v), z [n_seq, T, Hv*Dv],
    b and a [n_seq, T, Hv]; conv_state [n_seq, conv_dim, K-1] holds the last K-1 inputs of the convolution,
    state [n_seq, Hv, Dk, Dv] the delta rule's (float32). Returns y [n_seq, T, Hv*Dv] in qkv's dtype (out_proj's
    input) and both new states. `step`: gated_delta_rule's one-token step (default: delta_step, in torch), unused
    with `stepped`.
    """
    if stepped is not None:
        mixed, conv_state = stepped.causal_conv(qkv, conv_state, w.conv, None, silu=True, out_dtype=torch.float32)
        y, state = stepped.gated_delta_net(w, mixed, z, b, a, state)
        return y, conv_state, state
    mixed, conv_state = causal_conv(qkv.transpose(1, 2), conv_state, w.conv, None)
    q, k, v = F.silu(mixed.float()).transpose(1, 2).split([w.key_dim, w.key_dim, w.value_dim], dim=-1)
    # Normalized per key head, before each is copied to the value heads that read it.
    q, k = (w.to_value_heads(l2_normalize(t.unflatten(-1, (w.n_k_heads, w.k_head_dim)))) for t in (q, k))
    v = v.unflatten(-1, (w.n_v_heads, w.v_head_dim))
    beta = torch.sigmoid(b.float())
    g = w.A.float() * F.softplus(a.float() + w.dt_bias.float())  # the log of each step's decay, <= 0
    core, state = gated_delta_rule(q * w.k_head_dim ** -0.5, k, v, g, beta, state, step)
    y = norm_then_gate(core, z.unflatten(-1, (w.n_v_heads, w.v_head_dim)), w.norm, w.eps)
    return y.flatten(-2).to(qkv.dtype), conv_state, state


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dim, with transformers' (and FLA's) 1e-6 inside the square root."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def norm_then_gate(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' gated RMSNorm of the delta net, in float32 (or `dtype`): RMSNorm(y) * weight * silu(z) over the last dim
    (one value head). Unlike Mamba2's gated norm, the gate comes after the norm."""
    y = y.to(dtype)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.to(dtype) * F.silu(z.to(dtype))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, step=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head: S_t = exp(g_t) S_{t-1} + k_t u_t^T with u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t); o_t = S_t^T q_t.

    q and k [n, T, H, Dk] (already one per value head, normalized, q scaled), v [n, T, H, Dv], g (log decays,
    <= 0) and beta [n, T, H], state [n, H, Dk, Dv] = S_0. In float32. Runs DELTA_CHUNK tokens at a time: memory is
    linear in T. Returns o [n, T, H, Dv] and S_T. A single token goes through `step` (default: delta_step, in
    torch; the native one takes and returns the same), which must leave `state` as it was.
    """
    q, k, v, g, beta, state = (t.float() for t in (q, k, v, g, beta, state))
    if q.shape[1] == 1:  # decode: the recurrence itself is far cheaper than a block of one token
        return (step or delta_step)(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    outs = []
    for start in range(0, q.shape[1], DELTA_CHUNK):
        block = slice(start, start + DELTA_CHUNK)  # the last one may be shorter: nothing assumes a length
        heads_first = (t[:, block].transpose(1, 2) for t in (q, k, v, g, beta))  # [n, H, l, ...]
        out, state = _delta_block(*heads_first, state)
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=1), state


def delta_step(q, k, v, g, beta, state):
    """gated_delta_rule for one token: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H]. Returns o [n, 1, H, Dv]
    and the new state (a new tensor)."""
    k_q = torch.stack([k, q], dim=2)  # rows: [n, H, 2, Dk]
    decay = torch.exp(g)[..., None, None]
    # With S_t = decay S + k delta^T: S^T k and S^T q from one read of the old state (row times state: unlike
    # Mamba2's state times column, these products read the state row by row, a third of the time of a product and
    # a sum on CPU); the output o = decay S^T q + (k . q) delta needs no second read of the new state.
    k_read, q_read = (k_q @ state).unbind(2)
    delta = (v - decay[..., 0] * k_read) * beta[..., None]
    out = decay[..., 0] * q_read + (k * q).sum(-1, keepdim=True) * delta
    state = torch.mul(state, decay).addcmul_(k[..., None], delta[..., None, :])
    return out[:, None], state


def _delta_block(q, k, v, g, beta, state):
    """gated_delta_rule over one block of l tokens, heads first: q, k [n, H, l, Dk], v [n, H, l, Dv], g and
    beta [n, H, l].

    With c_t the log decay from the block's start through step t and D[t, s] = exp(c_t - c_s) for s <= t, the
    corrections u_t written into the state depend on those before them in the block:
        u_t + beta_t sum_{s<t} D[t, s] (k_t . k_s) u_s = beta_t v_t - beta_t exp(c_t) S_0^T k_t,
    a unit lower triangular system (the WY/UT form), solved for both right-hand sides at once. Then the outputs
    come from inside the block as decay-weighted causal attention over u, and from before it through S_0.
    """
    log_decay = g.cumsum(-1)  # c_t
    decay = torch.exp(_segment_sums(g))  # D, zero above the diagonal
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is taken as ones: unitriangular
    rhs = torch.cat([v * beta[..., None], k_beta * torch.exp(log_decay)[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    from_v, from_state = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    u = from_v - from_state @ state
    out = ((q @ k.transpose(-1, -2)) * decay) @ u + (q * torch.exp(log_decay)[..., None]) @ state
    to_end = torch.exp(log_decay[..., -1:] - log_decay)  # from each step to the block's end
    state = state * torch.exp(log_decay[..., -1])[..., None, None] + (k * to_end[..., None]).transpose(-1, -2) @ u
    return out, state
