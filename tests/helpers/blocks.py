"""Quantized blocks as a file has them: random levels with plausible scales, for every block format the kernels
read."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T



def block_weights(qtype: T) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def scale_bytes(rng, n: int) -> np.ndarray:
    """f16 scales as a file has them: mostly small, some negative, zero and subnormal ones too."""
    values = rng.standard_normal(n).astype(np.float32) * 0.01
    values[::7] = 0.0
    values[3::11] = -values[3::11]
    values[5::13] = 3e-7  # subnormal in f16
    return values.astype(np.float16).view(np.uint8).reshape(n, 2)


def exponent_bytes(rng, n: int) -> np.ndarray:
    """MXFP4's E8M0 exponents as a file has them: scales 2^(e - 128) of about 2^-10 .. 2^2."""
    return rng.integers(118, 131, size=(n, 1), dtype=np.uint8)


def ue4m3_bytes(rng, n: int) -> np.ndarray:
    """NVFP4's four E4M3 scales per block: any byte (0 and 0x7F read as zero)."""
    return rng.integers(0, 256, size=(n, 4), dtype=np.uint8)


# Where a block's scales are: the offsets of its f16 scales, of MXFP4's one exponent byte, of NVFP4's four E4M3 bytes.
SCALES_AT = {T.Q4_0: [0], T.Q5_0: [0], T.Q8_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
             T.Q6_K: [208], T.MXFP4: [0], T.Q2_K: [80, 82], T.Q3_K: [108], T.TQ1_0: [52], T.TQ2_0: [64],
             T.IQ4_NL: [0], T.IQ4_XS: [0], T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0],
             T.IQ1_S: [0], T.IQ1_M: [], T.NVFP4: [0]}


def scale_width(qtype: T) -> int:
    return {T.MXFP4: 1, T.NVFP4: 4}.get(qtype, 2)


def iq1m_scale(raw: np.ndarray, rng) -> None:
    """IQ1_M keeps its f16 d in the top nibbles of its four scale words (bytes 48-55): a plausible one there."""
    d = scale_bytes(rng, raw.shape[0]).view(np.uint16)[:, 0]
    words = raw[:, 48:56].copy().view(np.uint16)
    for u in range(4):
        words[:, u] = (words[:, u] & 0x0FFF) | (((d >> (4 * u)) & 15) << 12)
    raw[:, 48:56] = words.view(np.uint8)


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Rows of blocks with random levels and plausible scales: [rows, row_bytes] uint8."""
    rng = np.random.default_rng(seed)
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_weights, block_bytes), dtype=np.uint8)
    scales = {T.MXFP4: exponent_bytes, T.NVFP4: ue4m3_bytes}.get(qtype, scale_bytes)
    for at in SCALES_AT[qtype]:
        raw[:, at:at + scale_width(qtype)] = scales(rng, raw.shape[0])
    if qtype == T.IQ1_M:
        iq1m_scale(raw, rng)
    return raw.reshape(rows, -1)
