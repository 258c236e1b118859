"""How many activation rows one pass over a tile of 8 weight rows should multiply, per block type: each unpacked
register of levels serves every row of the pass, but past what the vector registers hold the compiler spills the
partial sums to the stack; 1-4 rows with AVX2's 16 registers, 1-8 with AVX-512VL's 32 (kvlm/kernels/csrc/dot.h,
default_pass_rows, holds the counts this measured).

    python -m bench.tile_passes [--types Q4_K Q6_K ...] [--rows 128] [--rounds 7]

A 1536 x 8960 matrix of random blocks (bench.low_bit_products') times `--rows` float32 activation rows with torch's
threads; for each type the counts 1-4 take turns, `--rounds` times, so that this VM's drift weighs on all alike.
Prints G multiply-adds/s (median) per count and as a share of the machine's int8 peak (bench.arith_peak).
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
from kvlm.kernels import NATIVE_TYPES, native_kernels  # noqa: E402

def rates(kernels, qtype: T, m: int, rounds: int) -> dict[int, float]:
    """G multiply-adds/s of the product at each count of rows per pass the build takes, the counts taking turns."""
    product, x = kernels.product([kernels.interleave(random_matrix(qtype))]), torch.randn(m, COLS)
    counts = range(1, kernels.max_tile_pass_rows + 1)
    times: dict[int, list[float]] = {count: [] for count in counts}
    try:
        for _ in range(rounds + 1):  # the first round warms up
            for count in counts:
                kernels.set_tile_pass_rows(qtype, count)
                started = time.perf_counter()
                product(x)
                times[count].append(time.perf_counter() - started)
    finally:
        kernels.set_tile_pass_rows(qtype, 0)
    return {count: ROWS * COLS * m / statistics.median(seconds[1:]) / 1e9 for count, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="*", default=[t.name for t in sorted(NATIVE_TYPES, key=int)])
    parser.add_argument("--rows", type=int, default=128, help="activation rows (a prompt's tokens)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None or not kernels.tiles:
        raise SystemExit("this machine's native kernels do not read tiles")
    threads = torch.get_num_threads()
    mix, peak = arith_peak.products_peak(arith_peak.peaks(threads))
    peak /= 1e9
    table = []
    for name in args.types:
        qtype = T[name]
        if not kernels.tiled(qtype):
            continue
        default = kernels.tile_pass_rows(qtype)
        by_count = rates(kernels, qtype, args.rows, args.rounds)
        best = max(by_count, key=by_count.get)
        table.append([name, *(f"{by_count[c]:.1f} ({by_count[c] / peak:.0%})" for c in by_count), best, default])
        print(table[-1], flush=True)
    print(f"\n{machine_line()}; {kernels.isa}; {threads} threads; {ROWS} x {COLS} times {args.rows} rows; "
          f"int8 peak ({mix}) {peak:.1f} G multiply-adds/s\n")
    counts = range(1, kernels.max_tile_pass_rows + 1)
    print(markdown_table(["type", *(f"{c} rows/pass G/s (of peak)" for c in counts), "fastest", "default"], table))


if __name__ == "__main__":
    main()
