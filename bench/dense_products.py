"""What kvlm's native dense product (kvlm/kernels/csrc/dense.h: each output row the same bits whatever the batch)
costs against torch's F.linear (MKL, whose rows depend on the batch) and oneDNN's packed product
(kvlm.model.linear.PackedLinear), by the number of rows, on the matrices of SmolLM2-135M and Qwen2.5-0.5B.

    python -m bench.dense_products [--rows 1 8 64 512] [--seconds 1]

Milliseconds per product (median), with torch's threads and float32 activations. The native product reads float32
weights, or bfloat16 weights as they are (half the bytes); MKL and oneDNN read float32 (bfloat16 weights converted
to float32 for them: the same product, so one timing serves both). The products take turns on each matrix: the
small models' matrices all fit the L3 cache together and read from it here, the larger ones evict each other and
stream from memory, as every matrix does in a real step.
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import machine_line, markdown_table  # noqa: E402
from kvlm.kernels import native_kernels  # noqa: E402
from kvlm.model.cpu import onednn_packs  # noqa: E402
from kvlm.model.linear import PackedLinear  # noqa: E402

# (model, matrix, out, in): a stacked Q/K/V (or a square attention matrix), gate/up stacked, and down.
MATRICES = [
    ("SmolLM2-135M", "q / o", 576, 576), ("SmolLM2-135M", "gate_up", 3072, 576), ("SmolLM2-135M", "down", 576, 1536),
    ("Qwen2.5-0.5B", "qkv", 1152, 896), ("Qwen2.5-0.5B", "gate_up", 9728, 896), ("Qwen2.5-0.5B", "down", 896, 4864),
]


def milliseconds(products: list, x: torch.Tensor, seconds: float) -> list[float]:
    """Each product's median time, the products taking turns (a machine's load that comes and goes then weighs on
    all of them alike), over as many rounds as fill about `seconds` (5 at least), after one call each to warm up."""
    started = time.perf_counter()
    for product in products:
        product(x)
    rounds = max(5, int(seconds / max(time.perf_counter() - started, 1e-6)))
    times: list[list[float]] = [[] for _ in products]
    for _ in range(rounds):
        for product, product_times in zip(products, times):
            begun = time.perf_counter()
            product(x)
            product_times.append(time.perf_counter() - begun)
    return [statistics.median(product_times) * 1e3 for product_times in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--seconds", type=float, default=1.0, help="time spent on each row count of a matrix")
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not available here")
    print(f"{machine_line()}; native kernels: {kernels.isa}\n")
    header = ["model", "matrix", "rows", "MKL f32 ms", "oneDNN f32 ms", "native f32 ms", "native bf16 ms",
              "f32 / MKL", "bf16 / MKL", "f32 / oneDNN"]
    rows_out = []
    for model, name, out_features, in_features in MATRICES:
        weight = torch.randn(out_features, in_features) * 0.05
        mkl = functools.partial(F.linear, weight=weight)
        onednn = PackedLinear(weight, torch.float32) if onednn_packs(torch.float32) else None
        native_f32, native_bf16 = kernels.dense(weight), kernels.dense(weight.bfloat16())
        for m in args.rows:
            x = torch.randn(m, in_features)
            products = [mkl, native_f32, native_bf16] + ([onednn] if onednn else [])
            mkl_ms, f32_ms, bf16_ms, *onednn_ms = milliseconds(products, x, args.seconds)
            onednn_ms = onednn_ms[0] if onednn_ms else float("nan")
            rows_out.append([model, f"{name} {out_features}x{in_features}", m, f"{mkl_ms:.3f}", f"{onednn_ms:.3f}",
                             f"{f32_ms:.3f}", f"{bf16_ms:.3f}", f"{f32_ms / mkl_ms:.2f}", f"{bf16_ms / mkl_ms:.2f}",
                             f"{f32_ms / onednn_ms:.2f}"])
            print(" | ".join(map(str, rows_out[-1])), flush=True)
    print()
    print(markdown_table(header, rows_out))


if __name__ == "__main__":
    main()
