"""How fast this machine reads memory: the floor under batch-1 decode, which reads every weight once per token.

    python -m bench.memory_bandwidth [--gib 2] [--repeats 5]

Sums a float32 tensor of --gib GiB (far larger than any cache) with torch's threads, best of --repeats: one read of
every byte, vectorized, nothing written. A model whose decode reads B bytes per token cannot beat GB/s / B tokens/s
on this machine; bench/RESULTS.md compares kvlm's decode with that floor.
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it pins OpenMP's threads

import argparse
import time

import torch

from bench.common import machine_line


def read_gb_per_s(gib: float, repeats: int) -> float:
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        float(data.sum())
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(machine_line())
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        print(f"{threads} thread(s): {read_gb_per_s(args.gib, args.repeats):.1f} GB/s read", flush=True)


if __name__ == "__main__":
    main()
