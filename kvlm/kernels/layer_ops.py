"""A decoder layer's small ops through the native library (csrc/layer_ops.h): one call each where torch runs
several eager ops (an RMSNorm in bfloat16 is eight of them; attention over a cache a gather, a conversion and
the fused kernel per group of tokens). Their torch references are the model's own ops (kvlm.model.ops), which the
tests compare these with."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvlm.memory.view import TokenCells

KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KV_Q8_0 = 3
HEAD_DIM_STEP = 16  # attention's head_dim must be a multiple of this (attention.h's HEAD_DIM_STEP)


class NativeLayerOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr, f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._attention = lib.kvlm_attention
        self._attention.argtypes = [ptr, i32, i64, i32, i32, i32, f32, ptr, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr,
                                    ptr, i32]
        self._rms_norm = lib.kvlm_rms_norm
        self._rms_norm.argtypes = [ptr, ptr, i32, i64, i64, ptr, f32, ptr, ptr, i32]
        self._rope = lib.kvlm_rope
        self._rope.argtypes = [ptr, i32, i64, i64, i32, i32, i32, ptr, ptr, i32]
        self._head_norm = lib.kvlm_head_norm
        self._head_norm.argtypes = [ptr, i32, i64, i64, i32, i32, ptr, f32, i32]
        self._gated = lib.kvlm_gated
        self._gated.argtypes = [ptr, i32, i64, i64, i32, ptr, i32]
        self._sigmoid_gate = lib.kvlm_sigmoid_gate
        self._sigmoid_gate.argtypes = [ptr, i32, i64, i64, ptr, i64, ptr, i32]
        self._softcap = lib.kvlm_softcap
        self._softcap.argtypes = [ptr, i64, i64, f32, i32]
        self._route = lib.kvlm_route
        self._route.argtypes = [ptr, ptr, i64, i32, i32, i32, ptr, ptr, i32]
        self._delta_step = lib.kvlm_delta_step
        self._delta_step.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32]

    @staticmethod
    def takes_head_dim(head_dim: int) -> bool:
        """Whether attention takes heads of this size."""
        return head_dim % HEAD_DIM_STEP == 0

    def attention(self, q: torch.Tensor, k_plane: tuple, v_plane: tuple, cells: TokenCells, scale: float,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, n_head, d] (float32 or bfloat16, contiguous) over the cells each token reads (`cells`, see
        TokenCells) of the K and V planes (each `(data [n_cells, n_kv, d], q8 scales or None)`, see
        KVPlane.native); [T, n_head * d]. `sinks`: [n_head] float32 (contiguous) sink logits joining each head's
        softmax, or None."""
        (k, k_scales), (v, v_scales) = k_plane, v_plane
        n_tokens, n_head, dim = q.shape
        kv_type = KV_Q8_0 if k_scales is not None else KV_TYPES[k.dtype]
        out = torch.empty(n_tokens, n_head * dim, dtype=q.dtype)
        status = self._attention(
            q.data_ptr(), q.dtype == torch.bfloat16, n_tokens, n_head, k.shape[1], dim, scale, k.data_ptr(),
            None if k_scales is None else k_scales.data_ptr(), v.data_ptr(),
            None if v_scales is None else v_scales.data_ptr(), kv_type, cells.cells.data_ptr(),
            cells.offsets.data_ptr(), cells.lengths.data_ptr(), None if sinks is None else sinks.data_ptr(),
            out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"attention cannot take n_head {n_head}, n_kv {k.shape[1]}, head_dim {dim} "
                             f"with this cache type")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * weight, x + residual) for x [rows, n] (contiguous); without `residual` the
        second is x itself."""
        out = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        self._rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), x.dtype == torch.bfloat16,
                       x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr(), total.data_ptr(),
                       torch.get_num_threads())
        return out, total

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, n_heads, d] in place (heads and values contiguous, tokens at any stride) by float32 cos
        and sin [T, r] (contiguous): each head's first r values (r = d, or fewer: partial RoPE)."""
        n_tokens, n_heads, dim = x.shape
        rotated = cos.shape[-1]
        if x.stride(2) != 1 or x.stride(1) != dim:
            raise ValueError("rope_ needs each token's heads contiguous")
        status = self._rope(x.data_ptr(), x.dtype == torch.bfloat16, n_tokens, x.stride(0), n_heads, dim, rotated,
                            cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"RoPE rotates an even number of each head's values, at most its {dim}; got {rotated}")
        return x

    def head_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of x [T, n_heads, d] in place (heads and values contiguous, tokens at any stride),
        head h times weight[h] ([n_heads, d], contiguous, x's dtype)."""
        n_tokens, n_heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim or weight.shape != (n_heads, dim) or not weight.is_contiguous():
            raise ValueError("head_norm_ needs each token's heads contiguous and a [n_heads, d] weight")
        self._head_norm(x.data_ptr(), x.dtype == torch.bfloat16, n_tokens, x.stride(0), n_heads, dim,
                        weight.data_ptr(), eps, torch.get_num_threads())
        return x

    def gated(self, gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        """act(gate) * up for gate_up [rows, 2n] (contiguous, gate first): [rows, n]."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._gated(gate_up.data_ptr(), gate_up.dtype == torch.bfloat16, rows, width // 2, gelu, out.data_ptr(),
                    torch.get_num_threads())
        return out

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate) for x [rows, n] (contiguous), gate [rows, n] or [rows, 1] (any float dtype)."""
        rows, width = x.shape
        gate = gate.to(torch.float32).contiguous()
        if gate.shape not in ((rows, width), (rows, 1)):
            raise ValueError(f"sigmoid_gate got x {tuple(x.shape)} and gate {tuple(gate.shape)}")
        out = torch.empty_like(x)
        self._sigmoid_gate(x.data_ptr(), x.dtype == torch.bfloat16, rows, width, gate.data_ptr(), gate.shape[1],
                           out.data_ptr(), torch.get_num_threads())
        return out

    def route(self, logits: torch.Tensor, n_used: int, normalize: bool,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] int32, weights [T, k] float32) from router logits [T, n_expert] float32 (plus `bias`
        [n_expert] float32): kvlm.model.moe.route's choice in one call."""
        logits = logits.float().contiguous()
        n_tokens, n_expert = logits.shape
        bias = None if bias is None else bias.float().contiguous()
        ids = torch.empty(n_tokens, n_used, dtype=torch.int32)
        weights = torch.empty(n_tokens, n_used, dtype=torch.float32)
        status = self._route(logits.data_ptr(), None if bias is None else bias.data_ptr(), n_tokens, n_expert, n_used,
                             normalize, ids.data_ptr(), weights.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"a router cannot choose {n_used} of {n_expert} experts")
        return ids, weights

    def softcap_(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        """cap * tanh(logits / cap) in place, for float32 logits [rows, n] (contiguous)."""
        self._softcap(logits.data_ptr(), logits.shape[0], logits.shape[1], cap, torch.get_num_threads())
        return logits

    def delta_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule for one token (kvlm.model.recurrent.delta_step): q, k [n, H, Dk], v [n, H, Dv],
        g (log decays) and beta [n, H], state [n, H, Dk, Dv]; computed in float32. Returns out [n, 1, H, Dv] and
        the new state in a new tensor: `state` is left as it was (it may be a view of the committed state)."""
        n_seq, n_heads, k_dim = q.shape
        v_dim = v.shape[-1]
        if (k.shape != q.shape or v.shape != (n_seq, n_heads, v_dim) or g.shape != (n_seq, n_heads)
                or beta.shape != g.shape or state.shape != (n_seq, n_heads, k_dim, v_dim)):
            raise ValueError(f"delta_step got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                             f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)}")
        q, k, v, g, beta, state = (t.to(torch.float32).contiguous() for t in (q, k, v, g, beta, state))
        new_state = torch.empty(state.shape, dtype=torch.float32)
        out = torch.empty(n_seq, 1, n_heads, v_dim, dtype=torch.float32)
        status = self._delta_step(state.data_ptr(), new_state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  g.data_ptr(), beta.data_ptr(), out.data_ptr(), n_seq * n_heads, k_dim, v_dim,
                                  torch.get_num_threads())
        if status:
            raise ValueError(f"delta_step cannot take Dk {k_dim}, Dv {v_dim}")
        return out, new_state
