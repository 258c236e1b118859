"""Quantized blocks as a file has them: random levels with plausible scales, for every block format the kernels
read."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


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


# Where a block's scales are: the offsets of its f16 scales, or of MXFP4's one exponent byte.
SCALES_AT = {T.Q4_0: [0], T.Q5_0: [0], T.Q8_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
             T.Q6_K: [208], T.MXFP4: [0]}


def scale_width(qtype: T) -> int:
    return 1 if qtype == T.MXFP4 else 2


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Rows of blocks with random levels and plausible scales: [rows, row_bytes] uint8."""
    rng = np.random.default_rng(seed)
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_weights, block_bytes), dtype=np.uint8)
    scales = exponent_bytes if qtype == T.MXFP4 else scale_bytes
    for at in SCALES_AT[qtype]:
        raw[:, at:at + scale_width(qtype)] = scales(rng, raw.shape[0])
    return raw.reshape(rows, -1)
