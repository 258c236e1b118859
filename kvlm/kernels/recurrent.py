"""The recurrent layers between their projections through the native library (csrc/recurrent.h): the depthwise
causal convolution, Mamba2's scan with its gated norm, and Qwen3.5's gated delta net, each token of each sequence
stepped in order with one fixed sequence of float32 operations. A token's result then has the same bits whether it
comes in a whole prompt, in pieces of it or alone, among other sequences or not, on any number of threads; the
torch references (kvlm.model.recurrent) run prompts through chunked algorithms instead, which the tests compare
these with.

Activations are float32 or bfloat16 [n_seq, T, width] (token rows may be strided: slices of one projection's
output are read where they lie); the scans' states are float32. A state passed as a tensor [n_seq, ...] comes back
as a new tensor (the one passed in may be a view of the committed state, so a failed call leaves it as it was); a
state passed as StatesInPlace (the memory's banks, kvlm.memory.recurrent) is read and written where it lies, and
comes back as it was passed.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvlm.core.states import StatesInPlace

if TYPE_CHECKING:
    from kvlm.model.recurrent import DeltaNetWeights, Mamba2Weights

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [n_seq, T, width] as the kernels read it, with its row stride: each token's values contiguous and the rows
    of all sequences evenly spaced (as in a slice of a wider tensor), else a contiguous copy."""
    if t.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"the native recurrent kernels take float32 or bfloat16 activations, not {t.dtype}")
    if t.stride(-1) != 1 or t.stride(0) != t.shape[1] * t.stride(1):
        t = t.contiguous()
    return t, t.stride(1)


def _floats(t: torch.Tensor | None) -> torch.Tensor | None:
    """A weight or state as the kernels read it: float32, contiguous."""
    return None if t is None else t.to(torch.float32).contiguous()


class _StateArgs:
    """A state argument as the kernels take it: each sequence's address to read and its address to write, and what
    the call returns as the new state (a new tensor, or the StatesInPlace it was given)."""

    def __init__(self, state: torch.Tensor | StatesInPlace, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
        if isinstance(state, StatesInPlace):
            if state.dtype not in dtypes:
                raise ValueError(f"a state in place in {state.dtype}: the kernel takes {dtypes}")
            self.dtype, self.new = state.dtype, state
            self.sources, self.targets = state.sources, state.targets
            return
        if state.dtype not in dtypes:
            state = state.to(dtypes[0])
        state = state.contiguous()
        new = torch.empty_like(state)
        self.dtype, self.new, self._state = state.dtype, new, state  # _state: the copy read, kept to the call
        self.sources, self.targets = _sequence_addresses(state), _sequence_addresses(new)

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16


def _sequence_addresses(t: torch.Tensor) -> torch.Tensor:
    """The address of each sequence's part of a contiguous t [n_seq, ...]."""
    return t.data_ptr() + torch.arange(t.shape[0], dtype=torch.int64) * (t[0].numel() * t.element_size())


def _check(status: int, what: str) -> None:
    if status:
        raise ValueError(f"the native recurrent kernels cannot take {what}")


class NativeRecurrentOps:
    steps_in_place = True  # takes StatesInPlace

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._delta_rule = lib.kvlm_delta_rule
        self._delta_rule.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32]
        self._causal_conv = lib.kvlm_causal_conv
        self._causal_conv.argtypes = [ptr, i32, i64, i64, i64, i64, ptr, i32, ptr, i32, ptr, i32, ptr, i32, ptr, i32]
        self._mamba2_scan = lib.kvlm_mamba2_scan
        self._mamba2_scan.argtypes = [ptr, ptr, i64, ptr, i64, i32, i64, i64, i32, i32, i32, i32, ptr, ptr, ptr, ptr,
                                      f32, f32, f32, ptr, ptr, ptr, i32]
        self._gated_delta_net = lib.kvlm_gated_delta_net
        self._gated_delta_net.argtypes = [ptr, ptr, i64, ptr, i64, ptr, i64, i32, i64, i64, i32, i32, i32, i32, i32,
                                          ptr, ptr, ptr, f32, ptr, ptr, ptr, i32]

    def causal_conv(self, x: torch.Tensor, state: torch.Tensor | StatesInPlace, weight: torch.Tensor,
                    bias: torch.Tensor | None, silu: bool = False,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | StatesInPlace]:
        """Depthwise causal convolution of x [n_seq, T, channels] by weight [channels, K] after each sequence's last
        K-1 inputs, state [n_seq, channels, K-1] (float32 or bfloat16), plus bias [channels] (or None), then SiLU
        if `silu`. Returns out [n_seq, T, channels] in out_dtype (default x's) and the new state in state's dtype.
        (kvlm.model.recurrent.causal_conv takes and returns [n_seq, channels, T] instead.)"""
        x, x_stride = _rows(x)
        n_seq, n_tokens, channels = x.shape
        taps = weight.shape[-1]
        if weight.shape != (channels, taps) or tuple(state.shape) != (n_seq, channels, taps - 1):
            raise ValueError(f"causal_conv got x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                             f"state {tuple(state.shape)}")
        if state.dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"causal_conv keeps its state in float32 or bfloat16, not {state.dtype}")
        state, weight, bias = _StateArgs(state, ACTIVATION_DTYPES), _floats(weight), _floats(bias)
        out = torch.empty(n_seq, n_tokens, channels, dtype=out_dtype or x.dtype)
        status = self._causal_conv(
            x.data_ptr(), x.dtype == torch.bfloat16, x_stride, n_seq, n_tokens, channels, state.sources.data_ptr(),
            state.bf16, weight.data_ptr(), taps, None if bias is None else bias.data_ptr(), silu,
            out.data_ptr(), out.dtype == torch.bfloat16, state.targets.data_ptr(), torch.get_num_threads())
        _check(status, f"a convolution of {n_tokens} tokens")
        return out, state.new

    def mamba2_scan(self, w: Mamba2Weights, xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor,
                    state: torch.Tensor | StatesInPlace) -> tuple[torch.Tensor, torch.Tensor | StatesInPlace]:
        """Mamba2's mixer between its convolution and out_proj (kvlm.model.recurrent.mamba2_mixer): xbc
        [n_seq, T, H*P + 2*G*N] the convolution's output after the SiLU (x, B, C), z [n_seq, T, H*P] and the raw
        dt [n_seq, T, H] from in_proj, state [n_seq, H, P, N]. Returns y [n_seq, T, H*P] in z's dtype (the gated
        norm's output, out_proj's input) and the new state (float32)."""
        (z, z_stride), (dt, dt_stride) = _rows(z), _rows(dt)
        n_seq, n_tokens = z.shape[:2]
        heads, head_dim, d_state, groups = w.n_heads, w.head_dim, w.d_state, w.n_groups
        if (xbc.shape != (n_seq, n_tokens, w.conv_dim) or z.shape[2] != w.d_inner or dt.shape[2] != heads
                or dt.dtype != z.dtype or tuple(state.shape) != (n_seq, heads, head_dim, d_state)):
            raise ValueError(f"mamba2_scan got xbc {tuple(xbc.shape)}, z {tuple(z.shape)}, dt {tuple(dt.shape)}, "
                             f"state {tuple(state.shape)}")
        xbc, state = _floats(xbc), _StateArgs(state)
        dt_bias, A_log, D, norm = (_floats(t) for t in (w.dt_bias, w.A_log, w.D, w.norm))
        out = torch.empty(n_seq, n_tokens, w.d_inner, dtype=z.dtype)
        status = self._mamba2_scan(
            xbc.data_ptr(), z.data_ptr(), z_stride, dt.data_ptr(), dt_stride, z.dtype == torch.bfloat16, n_seq,
            n_tokens, heads, head_dim, d_state, groups, dt_bias.data_ptr(), A_log.data_ptr(), D.data_ptr(),
            norm.data_ptr(), *w.time_step_limit, w.eps, state.sources.data_ptr(), state.targets.data_ptr(),
            out.data_ptr(), torch.get_num_threads())
        _check(status, f"{heads} heads in {groups} groups over {n_tokens} tokens")
        return out, state.new

    def gated_delta_net(self, w: DeltaNetWeights, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
                        a: torch.Tensor,
                        state: torch.Tensor | StatesInPlace) -> tuple[torch.Tensor, torch.Tensor | StatesInPlace]:
        """Qwen3.5's linear attention between its convolution and out_proj (kvlm.model.recurrent.gated_delta_net):
        mixed [n_seq, T, 2*Hk*Dk + Hv*Dv] the convolution's output after the SiLU (q, k, v), z [n_seq, T, Hv*Dv],
        b and a [n_seq, T, Hv] from the projections, state [n_seq, Hv, Dk, Dv]. Returns y [n_seq, T, Hv*Dv] in z's
        dtype (out_proj's input) and the new state (float32)."""
        (z, z_stride), (b, b_stride), (a, a_stride) = _rows(z), _rows(b), _rows(a)
        n_seq, n_tokens = z.shape[:2]
        v_heads, k_dim, v_dim = w.n_v_heads, w.k_head_dim, w.v_head_dim
        if (mixed.shape != (n_seq, n_tokens, w.conv_dim) or z.shape[2] != w.value_dim
                or b.shape != (n_seq, n_tokens, v_heads) or a.shape != b.shape or not z.dtype == b.dtype == a.dtype
                or tuple(state.shape) != (n_seq, v_heads, k_dim, v_dim)):
            raise ValueError(f"gated_delta_net got mixed {tuple(mixed.shape)}, z {tuple(z.shape)}, "
                             f"b {tuple(b.shape)}, a {tuple(a.shape)}, state {tuple(state.shape)}")
        mixed, state = _floats(mixed), _StateArgs(state)
        dt_bias, A, norm = (_floats(t) for t in (w.dt_bias, w.A, w.norm))
        out = torch.empty(n_seq, n_tokens, w.value_dim, dtype=z.dtype)
        status = self._gated_delta_net(
            mixed.data_ptr(), z.data_ptr(), z_stride, b.data_ptr(), b_stride, a.data_ptr(), a_stride,
            z.dtype == torch.bfloat16, n_seq, n_tokens, w.n_k_heads, v_heads, k_dim, v_dim, w.v_heads_tiled,
            dt_bias.data_ptr(), A.data_ptr(), norm.data_ptr(), w.eps, state.sources.data_ptr(),
            state.targets.data_ptr(), out.data_ptr(), torch.get_num_threads())
        _check(status, f"{v_heads} value heads over {w.n_k_heads} key heads, {n_tokens} tokens")
        return out, state.new

    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule stepped token by token (kvlm.model.recurrent.gated_delta_rule's arguments and
        results): q, k [n, T, H, Dk], v [n, T, H, Dv], g (log decays) and beta [n, T, H], state [n, H, Dk, Dv];
        in float32. Returns o [n, T, H, Dv] and the new state. One token gives NativeLayerOps.delta_step's bits."""
        n_seq, n_tokens, heads, k_dim = q.shape
        v_dim = v.shape[-1]
        if (k.shape != q.shape or v.shape != (n_seq, n_tokens, heads, v_dim) or g.shape != q.shape[:3]
                or beta.shape != g.shape or state.shape != (n_seq, heads, k_dim, v_dim)):
            raise ValueError(f"delta_rule got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                             f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)}")
        q, k, v, g, beta, state = (_floats(t) for t in (q, k, v, g, beta, state))
        out = torch.empty(n_seq, n_tokens, heads, v_dim, dtype=torch.float32)
        new_state = torch.empty_like(state)
        status = self._delta_rule(state.data_ptr(), new_state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  g.data_ptr(), beta.data_ptr(), out.data_ptr(), n_seq, n_tokens, heads, k_dim,
                                  v_dim, torch.get_num_threads())
        _check(status, f"{n_tokens} tokens of Dk {k_dim}, Dv {v_dim}")
        return out, new_state
