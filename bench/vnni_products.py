"""What VNNI's vpdpbusd does for the tile products: the same products in two builds of kvlm's kernels, this CPU's
(`-march=native`) and one without VNNI (`skylake-avx512` where the CPU runs AVX-512, else `x86-64-v3`), on the
same matrices, the builds taking turns.

    python -m bench.vnni_products [--types Q4_K Q6_K ...] [--rows 1 128 512] [--rounds 5]

A 1536 x 8960 matrix of random blocks of each type (bench.low_bit_products') times `--rows` float32 activation rows
with torch's threads, each build at its own default rows per pass. With VNNI the 8-bit products are summed into
int32 by one vpdpbusd where AVX2 takes vpmaddubsw and vpmaddwd (kvlm/kernels/csrc/dot.h, Dots): the same integers,
so the same bits (checked here on every product timed). Prints G multiply-adds/s (median) and the ratio, beside the
machine's int8 peaks (bench.arith_peak).
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from bench import arith_peak  # noqa: E402
from bench.common import machine_line, markdown_table  # noqa: E402
from bench.low_bit_products import COLS, ROWS, random_matrix  # noqa: E402
from kvlm.kernels.native import NativeKernels, build, cpu_flags  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4")


def without_vnni_march() -> str:
    flags = set(cpu_flags().split())
    return "skylake-avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags else "x86-64-v3"


def rates(builds: dict[str, NativeKernels], qtype: T, m: int, rounds: int) -> dict[str, float]:
    """G multiply-adds/s of each build's product, the builds taking turns; their outputs must be equal."""
    x = torch.randn(m, COLS)
    products = {name: kernels.product([kernels.interleave(random_matrix(qtype))]) for name, kernels in builds.items()}
    outputs = {name: product(x) for name, product in products.items()}  # also the warm-up
    first = next(iter(outputs.values()))  # random blocks hold some f16 NaNs: theirs must match too
    if not all(torch.isclose(first, out, rtol=0, atol=0, equal_nan=True).all() for out in outputs.values()):
        raise RuntimeError(f"{qtype.name}: the builds' products differ")
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(rounds):
        for name, product in products.items():
            started = time.perf_counter()
            product(x)
            times[name].append(time.perf_counter() - started)
    return {name: ROWS * COLS * m / statistics.median(seconds) / 1e9 for name, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", default=list(TYPES))
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 128, 512], help="activation rows (tokens)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    builds = {march: NativeKernels(build(march)) for march in ("native", without_vnni_march())}
    if not all(kernels.tiles for kernels in builds.values()):
        raise SystemExit("this machine's native kernels do not read tiles")
    threads = torch.get_num_threads()
    peaks = {name: value / 1e9 for name, value in arith_peak.peaks(threads).items()}
    (new, new_kernels), (old, old_kernels) = builds.items()
    table = []
    for m in args.rows:
        for name in args.types:
            by_build = rates(builds, T[name], m, args.rounds)
            ratio = by_build[new] / by_build[old]
            table.append([m, name, f"{by_build[old]:.1f}", f"{by_build[new]:.1f}", f"{ratio:.2f}x"])
            print(table[-1], flush=True)
    peaks_line = ", ".join(f"{name} {value:.0f}" for name, value in peaks.items())
    print(f"\n{machine_line()}; {threads} threads; {ROWS} x {COLS}; {new}: {new_kernels.isa}; {old}: "
          f"{old_kernels.isa}; peaks (G multiply-adds/s): {peaks_line}\n")
    print(markdown_table(["rows", "type", f"{old} G/s", f"{new} G/s", "ratio"], table))


if __name__ == "__main__":
    main()
