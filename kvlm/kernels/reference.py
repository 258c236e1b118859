"""The pure-torch side of the kernels: what runs where the native ones are absent, and what tests hold them to.

`dequantize` gives gguf's own values bit for bit (the same float32 operations in the same order, or for the 1- to
4-bit formats gguf's own dequantization); it serves loading when the native kernels are absent and the fp32
reference mode. `quantized_product` is the native product's exact definition: activations quantized to 8 bits as the
kernel quantizes them (per block of 256 for the formats of 256-weight super-blocks, else of 32, as llama.cpp does),
then exact arithmetic (float64), so the kernel must agree with it to float32 rounding.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvlm.kernels.blocks import NATIVE_TYPES, BlockMatrix

T = GGMLQuantizationType


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> 32 levels: the low nibbles first, then the high ones."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """A little-endian 32-bit word per block -> its 32 bits as 0/1 uint8."""
    word = qh.contiguous().view(torch.int32)
    return ((word >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_fifth_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of Q4_K/Q5_K from their 12 bytes."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((d & 63, (md & 15) | ((d >> 6) << 4)), dim=-1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def _k_levels(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 256 4-bit levels as [n, 8, 32]: each 32 bytes give their low nibbles, then their high ones."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat((qs & 15, qs >> 4), dim=2).reshape(-1, 8, 32)


def _q4_k(b):
    scales, mins = _k_scales_mins(b[:, 4:16])
    step, low = (_f16(b, 0) * scales)[..., None], (_f16(b, 2) * mins)[..., None]
    return (step * _k_levels(b[:, 16:]).float() - low).reshape(-1, 256)


def _q5_k(b):
    scales, mins = _k_scales_mins(b[:, 4:16])
    step, low = (_f16(b, 0) * scales)[..., None], (_f16(b, 2) * mins)[..., None]
    high = (b[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return (step * (_k_levels(b[:, 48:]) | (high << 4)).float() - low).reshape(-1, 256)


def _q6_k(b):
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat((ql & 15, ql >> 4), dim=2).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    q = (low | ((qh & 3).reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    step = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return (step[..., None] * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


# MXFP4's codes: FP4 (E2M1) values doubled, as gguf's MXFP4.kvalues.
_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) for uint8 exponents, as gguf's e8m0_to_fp32_half: the float's bits built directly (subnormal for
    e < 2), so every exponent is exact."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b):
    return _e8m0_half(b[:, :1]) * _MXFP4_VALUES[_nibbles(b[:, 1:]).long()]


_DEQUANTIZE = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k,
               T.Q5_K: _q5_k, T.Q6_K: _q6_k, T.MXFP4: _mxfp4}


def _with_gguf(qtype: GGMLQuantizationType):
    """The 1- to 4-bit formats (Q2_K, Q3_K, the I-quants, TQ, NVFP4) by gguf's own numpy dequantization: the torch
    path reads them only where the native kernels are absent, at load, so their speed there matters little."""
    def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(gguf_dequantize(blocks.numpy(), qtype).reshape(blocks.shape[0], -1))
    return dequantize_blocks


_DEQUANTIZE.update({qtype: _with_gguf(qtype) for qtype in NATIVE_TYPES - _DEQUANTIZE.keys()})


def dequantize(matrix: BlockMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gguf's values of a block matrix, [rows, n_cols], in float32 (or rounded to `dtype`)."""
    if matrix.interleaved:
        raise ValueError("the reference reads the file's layout; an interleaved matrix is read by the native kernels")
    if matrix.qtype not in _DEQUANTIZE:
        raise ValueError(f"no dequantization of {matrix.qtype.name} in kvlm (it reads {', '.join(t.name for t in _DEQUANTIZE)})")
    block_bytes = GGML_QUANT_SIZES[matrix.qtype][1]
    values = _DEQUANTIZE[matrix.qtype](matrix.blocks.reshape(-1, block_bytes))
    return values.reshape(matrix.shape).to(dtype)


def activation_block(qtype: GGMLQuantizationType) -> int:
    """How many activations share one step in products with weights of this format: 256 for the formats of
    256-weight super-blocks, else 32."""
    return 256 if GGML_QUANT_SIZES[qtype][0] == 256 else 32


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> int8 levels [m, k] and a step per block [m, k / block], as the native product makes them."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    step = blocks.abs().amax(-1) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    levels = torch.round(blocks * inverse[..., None])  # ties to even, as the kernel's nearbyint
    return levels.to(torch.int8).reshape(x.shape), step


def quantized_product(x: torch.Tensor, parts: list[BlockMatrix]) -> torch.Tensor:
    """What the native product computes, in float64: x quantized as each part's format wants, times its weights."""
    outputs = []
    for part in parts:
        block = activation_block(part.qtype)
        levels, step = quantize_activations(x, block)
        activations = (levels.double().reshape(*step.shape, block) * step.double()[..., None]).reshape(x.shape)
        outputs.append(activations @ dequantize(part).double().T)
    return torch.cat(outputs, dim=1)
