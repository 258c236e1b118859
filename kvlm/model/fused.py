"""A layer's small ops, each one native call where the kernels are built (kvlm.kernels.layer_ops), torch's ops
(kvlm.model.ops) otherwise: in the reference mode, in the batch-invariant mode, without a compiler, and while
torch.compile traces a graph (it cannot trace a ctypes call).

At batch 1 a small model's step is mostly such ops: an RMSNorm in bfloat16 is eight eager torch ops, RoPE five, the
gated activation three. The native ones compute in float32 and round once at the end, where torch rounds after
each step, so their results differ from torch's by at most a rounding of the activation dtype.
"""
from __future__ import annotations

import torch

from kvlm.kernels.layer_ops import NativeLayerOps
from kvlm.model.ops import apply_rope, rms_norm

ACTIVATIONS = ("silu", "gelu_tanh")


class LayerOps:
    def __init__(self, native: NativeLayerOps | None) -> None:
        self.native = native

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

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [T, heads, d] rotated by float32 cos, sin [T, 1, d] (in place where native)."""
        if self._use_native() and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]:
            return self.native.rope_(qk, cos, sin)
        return apply_rope(qk, cos.to(qk.dtype), sin.to(qk.dtype))

    def gated_mlp(self, x: torch.Tensor, gate_up, down, activation: str = "silu") -> torch.Tensor:
        """down(act(gate(x)) * up(x)): SwiGLU with "silu", GeGLU with "gelu_tanh"; gate and up stacked in one."""
        both = gate_up(x)
        if self._use_native() and both.is_contiguous():
            return down(self.native.gated(both, activation == "gelu_tanh"))
        gate, up = both.chunk(2, dim=-1)
        gate = torch.nn.functional.silu(gate) if activation == "silu" else \
            torch.nn.functional.gelu(gate, approximate="tanh")
        return down(gate * up)
