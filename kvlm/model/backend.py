"""The hot operations a decoder calls, as one table per device and mode: the models call `backend.norm(...)` and
never ask which kernels run it.

- `TorchBackend`: torch's ops alone, the reference every kernel is tested against, and the fallback: the reference
  mode, a machine without a compiler, a graph torch.compile traces (it cannot trace a ctypes call).
- `NativeCpuBackend`: kvlm's C++ kernels (kvlm.kernels) for each op whose inputs they take (a layout, a dtype),
  TorchBackend's op for the others; products read straight from a GGUF's blocks (or requantized ones), experts as
  one call over their blocks; decode steps as one native call per attention or Gated DeltaNet layer
  (kvlm.model.fused.DecodeLayers); attention, the delta rule and the recurrent layers natively.

kvlm.model.backends picks one (`backend_for`). A new device is one more entry there: a class of this interface over
its own kernels (the GPU's: kvlm.model.triton_backend), the models untouched.

At batch 1 a small model's step is mostly the small ops: an RMSNorm in bfloat16 is eight eager torch ops, RoPE five,
the gated activation three. The native ones compute in float32 and round once at the end, where torch rounds after
each step, so their results differ from torch's by at most a rounding of the activation dtype.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from kvlm.core.rope import apply_rope
from kvlm.kernels import BlockMatrix, dequantize
from kvlm.kernels.experts import ExpertBiases, NativeExperts
from kvlm.kernels.native import NativeKernels
from kvlm.kernels.quantize import BLOCK as QUANT_BLOCK
from kvlm.kernels.quantize import QUANTIZERS
from kvlm.model.linear import DenseLinear, Linear, QuantizedLinear, dense_linear
from kvlm.model.moe import BlockExperts, route
from kvlm.model.ops import rms_norm
from kvlm.model.recurrent import delta_step
from kvlm.model.recurrent_steps import SteppedRecurrentOps
from kvlm.model.settings import FROM_FILE

if TYPE_CHECKING:
    from kvlm.core.config import ModelConfig
    from kvlm.model.fused import DecodeLayers
    from kvlm.loader.tensors import Stored


class Backend(Protocol):
    """The table: what every backend offers a decoder."""

    name: str
    kernels: NativeKernels | None  # the library its quantized products, dequantization and experts come from
    recurrent: object | None  # stepped recurrent layers (kvlm.kernels.recurrent's interface), None: torch's scans

    def attention_kernel(self) -> object | None:
        """What attention over cells may call (kvlm.model.attention), None for torch's attention."""

    def matrix(self, parts: list[Stored], storage: str | None, dtype: torch.dtype,
               batch_invariant: bool) -> Linear:
        """The product of a matrix stacked by rows from `parts`, held as `storage` says (ComputeSettings.
        matrix_storage: its file's blocks, requantized, or dense) for activations in `dtype`."""

    def dense_matrix(self, weight: torch.Tensor, dtype: torch.dtype, batch_invariant: bool) -> Linear:
        """The product of a dense matrix with activations in `dtype`."""

    def products_layout(self) -> Callable[[BlockMatrix], BlockMatrix] | None:
        """What puts a block matrix (in place) in the layout this backend's products read, where that is not the
        file's (a tied embedding reads it there too); None where they read the file's."""

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A weight where this backend computes (its device)."""

    def block_experts(self, parts: list[Stored], storage: str | None, n_expert: int, activation: str,
                      biases: ExpertBiases | None, swiglu: tuple[float, float]) -> BlockExperts | None:
        """All experts of a layer (gate, up and down stored as [expert x rows, cols] each) as one call over their
        blocks, or None where this backend runs them as dense products, one expert at a time."""

    def decode_layers(self, config: ModelConfig, layers: list, dtype: torch.dtype,
                      activation: str = "silu") -> DecodeLayers | None:
        """Whole attention layers as one call each for decode steps, or None."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def head_norm(self, qk: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def gated_mlp(self, x: torch.Tensor, gate_up, down, activation: str = "silu") -> torch.Tensor: ...

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor: ...

    def gelu_times(self, gate: torch.Tensor, vector: torch.Tensor) -> torch.Tensor: ...

    def softcap(self, logits: torch.Tensor, cap: float) -> torch.Tensor: ...

    def route(self, logits: torch.Tensor, n_used: int, normalize: bool,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def delta_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TorchBackend:
    """torch's ops. `batch_invariant`: the transcendental functions (the activations, sigmoid, tanh) run in float64
    and round once: torch rounds a value differently in a tensor's vectorized body and in its scalar tail, which a
    float32 result would show and a rounded float64 one practically never does; recurrent layers step every token
    (kvlm.model.recurrent_steps)."""

    name = "torch"
    kernels: NativeKernels | None = None

    def __init__(self, batch_invariant: bool = False, device: str = "cpu") -> None:
        self.precise = torch.float64 if batch_invariant else None
        self.recurrent = SteppedRecurrentOps() if batch_invariant else None
        self.device = device

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.device == "cpu" else tensor.to(self.device)

    def attention_kernel(self) -> object | None:
        return None

    def matrix(self, parts: list[Stored], storage: str | None, dtype: torch.dtype,
               batch_invariant: bool) -> Linear:
        """Dense, whatever `storage` asks: torch multiplies no blocks (the reference mode, and the fallback where
        no compiler built the native kernels, whose settings never ask for blocks)."""
        weight = torch.cat([dequantize(part, dtype) if isinstance(part, BlockMatrix) else part for part in parts])
        return self.dense_matrix(weight, dtype, batch_invariant)

    def dense_matrix(self, weight: torch.Tensor, dtype: torch.dtype, batch_invariant: bool) -> Linear:
        if self.device != "cpu":  # (oneDNN's packed layouts and the native product are the CPU's)
            return DenseLinear(self.place(weight), dtype)
        return dense_linear(weight, dtype, batch_invariant, self.kernels)

    def products_layout(self) -> Callable[[BlockMatrix], BlockMatrix] | None:
        return None

    def block_experts(self, parts: list[Stored], storage: str | None, n_expert: int, activation: str,
                      biases: ExpertBiases | None, swiglu: tuple[float, float]) -> BlockExperts | None:
        return None

    def decode_layers(self, config: ModelConfig, layers: list, dtype: torch.dtype,
                      activation: str = "silu") -> DecodeLayers | None:
        return None

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + h) * weight, x + h): the residual add and the next norm."""
        x = x + h
        return rms_norm(x, weight, eps), x

    def head_norm(self, qk: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of qk [T, heads, d], head h times weight[h] (QK-norm)."""
        return F.rms_norm(qk, (qk.shape[-1],), eps=eps) * weight

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [T, heads, d] rotated by float32 cos, sin [T, 1, d] (over their width: partial RoPE)."""
        return apply_rope(qk, cos.to(qk.dtype), sin.to(qk.dtype))

    def gated_mlp(self, x: torch.Tensor, gate_up, down, activation: str = "silu") -> torch.Tensor:
        """down(act(gate(x)) * up(x)): SwiGLU with "silu", GeGLU with "gelu_tanh"; gate and up stacked in one."""
        return down(self._gated(gate_up(x), activation))

    def _gated(self, both: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = both.chunk(2, dim=-1)
        return self._torch(lambda g: F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh"), gate) * up

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x * sigmoid(gate), gate [rows, n] like x [rows, n] or [rows, 1] for each row (an attention output gate,
        a shared expert's)."""
        return x * self._torch(torch.sigmoid, gate).to(x.dtype)

    def gelu_times(self, gate: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        """gelu(gate) * vector (tanh approximation; per-layer inputs)."""
        return self._torch(lambda g: F.gelu(g, approximate="tanh"), gate) * vector

    def softcap(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        """cap * tanh(logits / cap) for float32 logits [rows, n] (a final logit softcap)."""
        return cap * self._torch(torch.tanh, logits / cap)

    def route(self, logits: torch.Tensor, n_used: int, normalize: bool,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A router's choice from its logits [T, n_expert] (plus `bias`): kvlm.model.moe.route."""
        return route(logits if bias is None else logits + bias, n_used, normalize)

    def delta_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule for one token (recurrent.delta_step): (out [n, 1, H, Dv], new state); the state
        passed in is left as it was."""
        return delta_step(q, k, v, g, beta, state)

    def _torch(self, function, x: torch.Tensor) -> torch.Tensor:
        """torch's `function` of x, in x's dtype: through float64 where batch-invariant (see the class)."""
        return function(x) if self.precise is None else function(x.to(self.precise)).to(x.dtype)


class NativeCpuBackend(TorchBackend):
    """kvlm's C++ kernels for this CPU, TorchBackend's ops where a kernel does not take the inputs or a graph is being
    traced. Recurrent layers step every token natively, prompts too (batch invariance by construction)."""

    name = "cpu"

    def __init__(self, kernels: NativeKernels, batch_invariant: bool = False) -> None:
        super().__init__(batch_invariant)
        self.kernels, self.native, self.recurrent = kernels, kernels.layer_ops, kernels.recurrent

    def _use_native(self) -> bool:
        return not torch.compiler.is_compiling()

    def attention_kernel(self) -> object | None:
        return self.native if self._use_native() else None

    def matrix(self, parts: list[Stored], storage: str | None, dtype: torch.dtype,
               batch_invariant: bool) -> Linear:
        """Blocks multiplied natively: the file's (each part rearranged in place: read for this matrix alone) or
        requantized ones; dense where `storage` says, or where requantized rows are not of whole blocks (16-wide
        per-layer inputs in a small model), float16 and bfloat16 parts then kept as stored (the native dense
        product reads them)."""
        if storage == FROM_FILE:
            return QuantizedLinear([self.kernels.interleave(part) for part in parts], dtype, self.kernels)
        if storage is None:
            return super().matrix(parts, storage, dtype, batch_invariant)
        weight = torch.cat([float_values(part) for part in parts])
        if weight.shape[-1] % QUANT_BLOCK:
            return self.dense_matrix(weight, dtype, batch_invariant)
        return QuantizedLinear([self.kernels.interleave(QUANTIZERS[storage](weight))], dtype, self.kernels)

    def products_layout(self) -> Callable[[BlockMatrix], BlockMatrix] | None:
        return self.kernels.interleave if self.kernels.tiles else None

    def block_experts(self, parts: list[Stored], storage: str | None, n_expert: int, activation: str,
                      biases: ExpertBiases | None, swiglu: tuple[float, float]) -> BlockExperts | None:
        """The file's blocks, or every expert's rows requantized in turn as the file stacks them."""
        if storage is None:
            return None
        if storage != FROM_FILE:
            parts = [_requantized(part, storage) for part in parts]
        blocks = [self.kernels.interleave(part) for part in parts]
        native = NativeExperts(self.kernels, *blocks, n_expert, activation, biases, *swiglu)
        return BlockExperts(native, (*blocks, biases))

    def decode_layers(self, config: ModelConfig, layers: list, dtype: torch.dtype,
                      activation: str = "silu") -> DecodeLayers | None:
        from kvlm.model.fused import DecodeLayers  # the fused layers read the decoder's weights records

        return DecodeLayers(self.kernels, config, layers, dtype, activation)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._use_native() and x.dim() == 2 and x.is_contiguous():
            return self.native.rms_norm(x, weight, eps)[0]
        return super().norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._use_native() and x.dim() == 2 and x.is_contiguous() and h.is_contiguous():
            return self.native.rms_norm(x, weight, eps, residual=h)
        return super().add_norm(x, h, weight, eps)

    def head_norm(self, qk: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """In place."""
        if self._use_native() and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]:
            return self.native.head_norm_(qk, weight, eps)
        return super().head_norm(qk, weight, eps)

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place (whole heads, or their first cos.shape[-1] values), rounded once."""
        if self._use_native() and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2] and cos.is_contiguous():
            return self.native.rope_(qk, cos, sin)
        return super().rope(qk, cos, sin)

    def gated_mlp(self, x: torch.Tensor, gate_up, down, activation: str = "silu") -> torch.Tensor:
        both = gate_up(x)
        if self._use_native() and both.is_contiguous():
            return down(self.native.gated(both, activation == "gelu_tanh"))
        return down(self._gated(both, activation))

    def sigmoid_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self._use_native() and x.dim() == 2 and x.is_contiguous():
            return self.native.sigmoid_gate(x, gate)
        return super().sigmoid_gate(x, gate)

    def gelu_times(self, gate: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        """The gated activation over the two side by side."""
        if self._use_native() and gate.dim() == 2:
            return self.native.gated(torch.cat([gate, vector.to(gate.dtype)], dim=-1), True)
        return super().gelu_times(gate, vector)

    def softcap(self, logits: torch.Tensor, cap: float) -> torch.Tensor:
        if self._use_native() and logits.dim() == 2 and logits.is_contiguous():
            return self.native.softcap_(logits, cap)
        return super().softcap(logits, cap)

    def route(self, logits: torch.Tensor, n_used: int, normalize: bool,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One native call in place of softmax, top-k and renormalisation's few torch ops per layer."""
        if self._use_native() and logits.dim() == 2:
            return self.native.route(logits, n_used, normalize, bias)
        return super().route(logits, n_used, normalize, bias)

    def delta_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._use_native():
            return self.native.delta_step(q, k, v, g, beta, state)
        return super().delta_step(q, k, v, g, beta, state)


def float_values(stored: Stored) -> torch.Tensor:
    """A stored tensor's values in float32 (what requantization reads)."""
    return dequantize(stored) if isinstance(stored, BlockMatrix) else stored.float()


def _requantized(stored: Stored, storage: str) -> BlockMatrix:
    """A stored tensor's rows (of every expert in turn, for a stack of them) in the blocks of `storage`."""
    values = float_values(stored)
    return QUANTIZERS[storage](values.reshape(-1, values.shape[-1]))
