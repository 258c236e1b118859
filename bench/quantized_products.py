"""What kvlm's native product straight from the file's blocks costs against oneDNN's bf16 GEMM on a packed dense
copy, by the number of rows, on the matrices of real models (random blocks of the formats their Q4_K_M / Q4_1 files
use). kvlm multiplies natively at every row count (a row's bits then do not depend on its batch); the copy is what
that gives up on CPUs with native bf16 instructions, where it wins above a few rows.

    python -m bench.quantized_products [--rows 1 2 4 8 16 32 64 512]

Milliseconds per product, median of repeats, with torch's threads. Each matrix is multiplied again and again, so one that fits the L3 cache
(the small models' bf16 copies do) reads from it here, while in a real step every matrix streams from memory: read
the small models' rows with that in mind (at one row their decode runs twice as fast natively as through the
copies, measured end to end).
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from bench.common import machine_line, markdown_table  # noqa: E402
from kvlm.kernels import BlockMatrix, native_kernels  # noqa: E402
from kvlm.model.linear import PackedLinear, QuantizedLinear  # noqa: E402

# (model, matrix, out, in, format): a stacked Q/K/V, gate/up and down of each.
MATRICES = [
    ("SmolLM2-135M", "qkv", 960, 576, T.Q4_1), ("SmolLM2-135M", "gate_up", 3072, 576, T.Q4_1),
    ("SmolLM2-135M", "down", 576, 1536, T.Q4_1),
    ("Qwen2.5-0.5B", "qkv", 1152, 896, T.Q5_0), ("Qwen2.5-0.5B", "gate_up", 9728, 896, T.Q5_0),
    ("Qwen2.5-0.5B", "down", 896, 4864, T.Q4_K),
    ("Qwen2.5-7B", "qkv", 4608, 3584, T.Q4_K), ("Qwen2.5-7B", "gate_up", 37888, 3584, T.Q4_K),
    ("Qwen2.5-7B", "down", 3584, 18944, T.Q6_K),
]


def random_matrix(rows: int, cols: int, qtype: T) -> BlockMatrix:
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block_weights * block_bytes), dtype=np.uint8)
    scale_at = {T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}[qtype]
    for at in scale_at:  # plausible f16 scales: random bytes would hold infinities and NaNs
        blocks = raw.reshape(-1, block_bytes)
        blocks[:, at:at + 2] = np.full(len(blocks), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    return BlockMatrix(torch.from_numpy(raw), qtype, cols)


def milliseconds(product, x: torch.Tensor, repeats: int) -> float:
    product(x)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        product(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not available here")
    print(f"{machine_line()}; native kernels: {kernels.isa}\n")
    rows_out = []
    for model, name, out_features, in_features, qtype in MATRICES:
        matrix = random_matrix(out_features, in_features, qtype)
        copy = PackedLinear(kernels.dequantize(matrix, torch.bfloat16), torch.bfloat16)
        native = QuantizedLinear([kernels.interleave(matrix)], torch.bfloat16, kernels)
        for m in args.rows:
            x = torch.randn(m, in_features, dtype=torch.bfloat16)
            native_ms, copy_ms = milliseconds(native, x, args.repeats), milliseconds(copy, x, args.repeats)
            rows_out.append([model, f"{name} {out_features}x{in_features} {qtype.name}", m, f"{native_ms:.3f}",
                             f"{copy_ms:.3f}", f"{copy_ms / native_ms:.2f}"])
            print(" | ".join(map(str, rows_out[-1])), flush=True)
    print(markdown_table(["model", "matrix", "rows", "native ms", "bf16 copy ms", "copy / native"], rows_out))


if __name__ == "__main__":
    main()
