"""One native call per decoder layer for decode tokens (csrc/decode_layer.h): the layer's description is made once
(its shapes, norms and matrices as C structures), a step's (RoPE, cells, the KV store's planes) once per micro-batch
view, and each call then passes only pointers. Its reference is the layer run op by op (kvlm.model.decoder with the
native layer ops), which the tests compare it with."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvlm.kernels.layer_ops import KV_Q8_0, KV_TYPES
from kvlm.kernels.native import NativeKernels, NativeProduct

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class MatrixSpec(ctypes.Structure):
    _fields_ = [("n_parts", ctypes.c_int), ("types", ctypes.POINTER(_i32)), ("weights", ctypes.POINTER(_ptr)),
                ("rows", ctypes.POINTER(_i64)), ("interleaved", ctypes.POINTER(_i32)), ("k", _i64)]

    @classmethod
    def of(cls, product: NativeProduct) -> MatrixSpec:
        arrays = product.c_arrays
        return cls(len(product.parts), *(ctypes.cast(a, ctypes.POINTER(t)) for a, t in
                                         zip(arrays, (_i32, _ptr, _i64, _i32))), product.in_features)


class LayerSpec(ctypes.Structure):
    _fields_ = [("bf16", ctypes.c_int), ("gelu", ctypes.c_int), ("qk_norm_whole", ctypes.c_int),
                ("n_head", ctypes.c_int), ("n_kv", ctypes.c_int),
                ("d", ctypes.c_int), ("n_embd", _i64), ("n_ff", _i64), ("eps", _f32), ("query_scale", _f32),
                ("attention_scale", _f32), ("attn_norm", _ptr), ("qkv_bias", _ptr), ("qk_norm", _ptr),
                ("post_attention_norm", _ptr), ("ffn_norm", _ptr), ("post_ffw_norm", _ptr), ("output_bias", _ptr),
                ("sinks", _ptr), ("qkv", MatrixSpec),
                ("output", MatrixSpec), ("gate_up", MatrixSpec), ("down", MatrixSpec), ("computes_kv", ctypes.c_int),
                ("v_from_k", ctypes.c_int), ("value_norm", ctypes.c_int), ("per_layer_width", _i64),
                ("per_layer_gate", MatrixSpec), ("per_layer_proj", MatrixSpec), ("per_layer_norm", _ptr),
                ("output_scale", _ptr), ("output_gate", ctypes.c_int), ("rope_dims", ctypes.c_int)]


class StepSpec(ctypes.Structure):
    _fields_ = [("n_tokens", _i64), ("cos", _ptr), ("sin", _ptr), ("write_cells", _ptr), ("cells", _ptr),
                ("offsets", _ptr), ("lengths", _ptr), ("k", _ptr), ("k_scales", _ptr), ("v", _ptr),
                ("v_scales", _ptr), ("kv_type", ctypes.c_int), ("n_cells", _i64)]


@dataclass(frozen=True)
class LayerShape:
    n_head: int
    n_kv: int  # the KV heads its attention reads
    head_dim: int
    n_embd: int
    n_ff: int
    eps: float
    query_scale: float
    gelu: bool
    qk_norm_whole: bool = False  # the QK-norm over each token's whole Q and K projections (OLMoE)
    computes_kv: bool = True  # False: it reads the K/V another layer wrote (Gemma 4's shared layers)
    v_from_k: bool = False  # V is K as projected, before K's norm (no V projection)
    value_norm: bool = False  # V heads through a weightless RMSNorm
    per_layer_width: int = 0  # the width of its per-layer input (Gemma 4), 0 for none
    output_gate: bool = False  # each query head beside its gate: the attention's output x sigmoid(gate) (Qwen3.5)
    rope_dims: int = 0  # RoPE over each head's first rope_dims values; 0: the whole head


class NativeDecodeLayer:
    """A decoder layer's weights as the native call reads them. `vectors` are its norms, biases and output scale,
    tensors in the activation dtype, and its attention sinks in float32 (None where the family has none); `products`
    its matrices' native products (qkv, output, gate_up and down; per_layer_gate and per_layer_proj where it has a
    per-layer input)."""

    def __init__(self, kernels: NativeKernels, shape: LayerShape, dtype: torch.dtype, vectors: dict,
                 products: dict[str, NativeProduct]) -> None:
        self._call = kernels.decode_layer_function
        self._keep = [v for v in vectors.values() if v is not None]  # the pointers below stay valid
        pointer = lambda name: None if vectors.get(name) is None else vectors[name].data_ptr()  # noqa: E731
        self.spec = LayerSpec(
            int(dtype == torch.bfloat16), int(shape.gelu), int(shape.qk_norm_whole), shape.n_head, shape.n_kv, shape.head_dim, shape.n_embd,
            shape.n_ff, shape.eps, shape.query_scale, shape.head_dim ** -0.5,
            *(pointer(n) for n in ("attn_norm", "qkv_bias", "qk_norm", "post_attention_norm", "ffn_norm",
                                   "post_ffw_norm", "output_bias", "sinks")),
            *(self._matrix(products, n) for n in ("qkv", "output", "gate_up", "down")),  # no MLP: experts
            int(shape.computes_kv), int(shape.v_from_k), int(shape.value_norm), shape.per_layer_width,
            *(self._matrix(products, n) for n in ("per_layer_gate", "per_layer_proj")),
            pointer("per_layer_norm"), pointer("output_scale"), int(shape.output_gate),
            shape.rope_dims or shape.head_dim)
        self.dtype = dtype

    @staticmethod
    def _matrix(products: dict[str, NativeProduct], name: str) -> MatrixSpec:
        return MatrixSpec.of(products[name]) if products.get(name) is not None else MatrixSpec()

    def __call__(self, x: torch.Tensor, step: DecodeStep, layer: int, normed_out: torch.Tensor | None = None,
                 per_layer: torch.Tensor | None = None) -> torch.Tensor:
        """x [n_tokens, n_embd] (contiguous, the activation dtype) through the layer, in place; the tokens' K and V
        written to their cells of `layer` in the step's store. A layer made without an MLP (its experts run
        after) stops after the attention's residual add and writes the experts' input into `normed_out`.
        `per_layer`: the tokens' per-layer input vectors [n_tokens, width] of a layer that has one (rows may be
        strided, each contiguous, in the activation dtype)."""
        vectors, stride = (None, 0) if per_layer is None else (per_layer.data_ptr(), per_layer.stride(0))
        status = self._call(ctypes.byref(self.spec), ctypes.byref(step.spec), layer, x.data_ptr(),
                            None if normed_out is None else normed_out.data_ptr(), vectors, stride,
                            torch.get_num_threads())
        if status:
            raise ValueError(f"the native decode layer cannot take these shapes or this cache (status {status})")
        return x


def layer_times(kernels: NativeKernels, on: bool) -> dict[str, float]:
    """Seconds the fused layers have spent so far in their weight products, attention and other ops (summed while
    timing is on; `on` switches it for the calls that follow)."""
    function = kernels.layer_times_function
    sums = (ctypes.c_double * 3)()
    function(int(on), sums)
    return dict(zip(("products", "attention", "other"), sums))


class DecodeStep:
    """What one micro-batch's tokens bring to every layer that attends through the same view: their RoPE (cos, sin
    float32 [n_tokens, head_dim]), the cells they write and read (`cells`, see kvlm.memory.view.TokenCells), and the
    KV store."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, write_cells: torch.Tensor, cells, store) -> None:
        (k, k_scales), (v, v_scales) = store.k.stored(), store.v.stored()
        planes = (k, k_scales, v, v_scales)
        kv_type = KV_Q8_0 if k_scales is not None else KV_TYPES[k.dtype]
        self._keep = (cos, sin, write_cells, cells, planes)
        self.spec = StepSpec(len(write_cells), cos.data_ptr(), sin.data_ptr(), write_cells.data_ptr(),
                             cells.cells.data_ptr(), cells.offsets.data_ptr(), cells.lengths.data_ptr(),
                             *(None if p is None else p.data_ptr() for p in planes), kv_type, store.n_cells)
