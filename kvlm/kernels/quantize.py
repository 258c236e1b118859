"""Float matrices into GGUF blocks, as gguf's (and llama.cpp's reference) quantizers make them, bit for bit:
`--quant int8` stores a float matrix as Q8_0, `--quant int4` as Q4_1 (a step and a minimum per 32 weights: it gives
a Q4_1 file's own blocks back, and is closer than Q4_0's symmetric levels), which the native products then read."""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from kvlm.kernels.blocks import BlockMatrix

BLOCK = 32


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    """Rounding as C's roundf, written as gguf writes it (floor(|x|) + floor(2 * fraction))."""
    magnitude = values.abs()
    whole = magnitude.floor()
    return torch.sign(values) * (whole + (2 * (magnitude - whole)).floor())


def _inverse(step: torch.Tensor) -> torch.Tensor:
    return torch.where(step == 0, torch.zeros_like(step), 1 / step)


def quantize_q8_0(weight: torch.Tensor) -> BlockMatrix:
    """Per 32 weights: d = max|w| / 127 (stored as f16), q = round(w / d)."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(-1, BLOCK)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    levels = _round_half_away(blocks * _inverse(step)).to(torch.int8)
    raw = torch.cat((step.half().view(torch.uint8), levels.view(torch.uint8)), dim=1)
    return BlockMatrix(raw.reshape(rows, -1), GGMLQuantizationType.Q8_0, cols)


def quantize_q4_0(weight: torch.Tensor) -> BlockMatrix:
    """Per 32 weights: d = (the weight of largest magnitude) / -8 (stored as f16), q = trunc(w / d + 8.5) in 0..15,
    weights 0-15 in the low nibbles and 16-31 in the high ones."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(-1, BLOCK)
    largest = blocks.gather(1, blocks.abs().argmax(-1, keepdim=True))
    step = largest / -8
    levels = (blocks * _inverse(step) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
    packed = levels[:, :16] | (levels[:, 16:] << 4)
    raw = torch.cat((step.half().view(torch.uint8), packed), dim=1)
    return BlockMatrix(raw.reshape(rows, -1), GGMLQuantizationType.Q4_0, cols)


def quantize_q4_1(weight: torch.Tensor) -> BlockMatrix:
    """Per 32 weights: d = (max - min) / 15 and m = min (stored as f16), q = trunc((w - min) / d + 0.5) in 0..15."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(-1, BLOCK)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = (high - low) / 15
    levels = ((blocks - low) * _inverse(step) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
    packed = levels[:, :16] | (levels[:, 16:] << 4)
    raw = torch.cat((step.half().view(torch.uint8), low.half().view(torch.uint8), packed), dim=1)
    return BlockMatrix(raw.reshape(rows, -1), GGMLQuantizationType.Q4_1, cols)


QUANTIZERS = {"int8": quantize_q8_0, "int4": quantize_q4_1}
