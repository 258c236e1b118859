"""The native product of every block type at batch-1 decode: a 1536 x 8960 matrix (Qwen2.5-1.5B's ffn_down shape) of
random blocks times one activation row, milliseconds (median of repeats), in the layout the loader gives it (tiles
where the type has them, else the file's rows read by the row kernel).

    python -m bench.low_bit_products [--types Q4_K Q2_K ...] [--threads 1] [--repeats 15]

Random levels with plausible scales (tests/helpers/blocks.py's, written again here so bench/ needs no tests/): the
speed of a product does not depend on the values.
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from bench.common import machine_line, markdown_table, median_seconds  # noqa: E402
from kvlm.kernels import NATIVE_TYPES, BlockMatrix, native_kernels  # noqa: E402

ROWS, COLS = 1536, 8960


def random_matrix(qtype: T) -> BlockMatrix:
    """Random bytes, every f16 the format may hold at byte 0 (most have their d there) made small: levels and
    indices random, scales plausible enough that no product overflows."""
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(ROWS * COLS // block_weights, block_bytes), dtype=np.uint8)
    raw[:, 1] &= 0x1f  # the high byte of an f16 at byte 0: below 2^-1, never inf or NaN
    return BlockMatrix(torch.from_numpy(raw.reshape(ROWS, -1)), qtype, COLS)


def milliseconds(kernels, qtype: T, repeats: int) -> tuple[float, bool]:
    matrix = kernels.interleave(random_matrix(qtype))
    product, x = kernels.product([matrix]), torch.randn(1, COLS)
    median_seconds(lambda: product(x), 3)  # warm-up
    return median_seconds(lambda: product(x), repeats) * 1e3, matrix.interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", default=[t.name for t in sorted(NATIVE_TYPES, key=int)])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not built here")
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.types:
        ms, tiled = milliseconds(kernels, T[name], args.repeats)
        rows.append([name, "tiles" if tiled else "rows", f"{ms:.2f}", f"{ROWS * COLS / ms / 1e6:.1f}"])
        print(rows[-1], flush=True)
    print(f"\n{machine_line()}; {kernels.isa}; {args.threads} thread(s); {ROWS} x {COLS} times 1 row\n")
    print(markdown_table(["type", "layout", "ms", "G weights/s"], rows))


if __name__ == "__main__":
    main()
