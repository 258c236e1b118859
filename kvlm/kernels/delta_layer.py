"""One native call per Gated DeltaNet layer (Qwen3.5) for decode tokens (csrc/delta_layer.h): the layer's norms and
MLP as the attention layers' LayerSpec, its mixer's projections and delta-rule weights as a DeltaMixerSpec, each made
once; a call passes the residual stream and the addresses of each sequence's states in the memory's banks. Its
reference is the layer run op by op (kvlm.model.blocks with the native layer ops and recurrent kernels), which the
tests compare it with bit for bit."""
from __future__ import annotations

import ctypes

import torch

from kvlm.core.states import StatesInPlace
from kvlm.kernels.decode_layer import LayerSpec, MatrixSpec
from kvlm.kernels.native import NativeKernels, NativeProduct

_int, _f32, _ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class DeltaMixerSpec(ctypes.Structure):
    _fields_ = [("in_proj", MatrixSpec), ("out_proj", MatrixSpec), ("conv", _ptr), ("taps", _int),
                ("n_k_heads", _int), ("n_v_heads", _int), ("dk", _int), ("dv", _int), ("v_heads_tiled", _int),
                ("dt_bias", _ptr), ("A", _ptr), ("norm", _ptr), ("eps", _f32)]


class NativeDeltaLayer:
    """A Gated DeltaNet layer's weights as the native call reads them: `norms` its attn_norm and ffn_norm (the
    activation dtype), `mixer` its DeltaNetWeights (kvlm.model.recurrent), `products` the native products of
    in_proj, out_proj and, unless its experts replace the MLP, gate_up and down."""

    def __init__(self, kernels: NativeKernels, n_embd: int, n_ff: int, eps: float, gelu: bool, dtype: torch.dtype,
                 norms: tuple[torch.Tensor, torch.Tensor], mixer, products: dict[str, NativeProduct]) -> None:
        self._call = kernels.delta_layer_function
        attn_norm, ffn_norm = (n.contiguous() for n in norms)
        floats = [t.to(torch.float32).contiguous() for t in (mixer.conv, mixer.dt_bias, mixer.A, mixer.norm)]
        self._keep = (attn_norm, ffn_norm, *floats)  # the pointers below stay valid
        mlp = [MatrixSpec.of(products[n]) if products.get(n) is not None else MatrixSpec()  # no MLP: experts
               for n in ("gate_up", "down")]
        self.spec = LayerSpec(int(dtype == torch.bfloat16), int(gelu), 0, 0, 0, 0, n_embd, n_ff, eps, 1.0, 0.0,
                              attn_norm.data_ptr(), None, None, None, ffn_norm.data_ptr(), None, None, None,
                              MatrixSpec(), MatrixSpec(), *mlp)
        conv, dt_bias, A, norm = (t.data_ptr() for t in floats)
        self.mixer = DeltaMixerSpec(MatrixSpec.of(products["in_proj"]), MatrixSpec.of(products["out_proj"]), conv,
                                    mixer.conv.shape[-1], mixer.n_k_heads, mixer.n_v_heads, mixer.k_head_dim,
                                    mixer.v_head_dim, int(mixer.v_heads_tiled), dt_bias, A, norm, mixer.eps)

    def __call__(self, x: torch.Tensor, states: list[StatesInPlace], n_tokens: int,
                 normed_out: torch.Tensor | None = None) -> torch.Tensor:
        """x [n_seq * n_tokens, n_embd] (contiguous, the activation dtype, sequence by sequence) through the layer,
        in place; `states` the convolution's and the delta rule's, stepped where they lie. A layer made without an
        MLP (its experts run after) stops after the mixer's residual add and writes the experts' input into
        `normed_out`."""
        conv, delta = states
        status = self._call(ctypes.byref(self.spec), ctypes.byref(self.mixer), conv.shape[0], n_tokens,
                            conv.sources.data_ptr(), conv.targets.data_ptr(), delta.sources.data_ptr(),
                            delta.targets.data_ptr(), x.data_ptr(),
                            None if normed_out is None else normed_out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"the native Gated DeltaNet layer cannot take these shapes (status {status})")
        return x
