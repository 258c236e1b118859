"""A decode step's attention against the memory it reads: every sequence's token over its own cached K and V rows,
layer after layer, as a batch of decode tokens runs it (kvlm's native kernel over a bfloat16 cache, the defaults'
where activations are bfloat16; `--kv-dtype float16` for an f16 cache).

    python -m bench.decode_attention [--sequences 64] [--context 300] [--layers 30] [--heads 9 3 64] [--repeats 5]

Each layer has its own K and V planes of `--sequences` x `--context` cells (sequence s in cells s * context ...),
so a step reads sequences x context x layers x n_kv x head_dim x 2 (K, V) x 2 bytes, more than the caches hold at
the defaults (SmolLM2-135M's heads, 64 sequences of 300 tokens: 442 MB). Prints ms per step (the median of
repeats) and the K/V bytes read per second beside this machine's read bandwidth (bench.memory_bandwidth): where
decode attention sits against its floor.
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it pins OpenMP's threads

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.common import machine_line  # noqa: E402
from bench.memory_bandwidth import read_gb_per_s  # noqa: E402
from kvlm.kernels import native_kernels  # noqa: E402
from kvlm.memory.view import TokenCells  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--context", type=int, default=300, help="cells each sequence's token reads")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("N_HEAD", "N_KV", "HEAD_DIM"))
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ops = native_kernels().layer_ops
    n_head, n_kv, dim = args.heads
    n, context, dtype = args.sequences, args.context, getattr(torch, args.kv_dtype)
    planes = [(torch.randn(n * context, n_kv, dim).to(dtype), torch.randn(n * context, n_kv, dim).to(dtype))
              for _ in range(args.layers)]
    q = torch.randn(n, n_head, dim).to(torch.bfloat16)
    cells = TokenCells(torch.arange(n * context), torch.arange(n) * context, torch.full((n,), context))

    def step() -> None:
        for k, v in planes:
            ops.attention(q, (k, None), (v, None), cells, dim ** -0.5)

    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    read = n * context * args.layers * n_kv * dim * 2 * dtype.itemsize
    bandwidth = read_gb_per_s(2.0, 3)
    print(machine_line())
    print(f"{n} sequences x {context} cells, {args.layers} layers, heads {n_head}/{n_kv} x {dim}, {args.kv_dtype} "
          f"cache: {seconds * 1e3:.2f} ms a step, {read / 1e6:.0f} MB of K and V read at {read / seconds / 1e9:.1f} "
          f"GB/s = {read / seconds / 1e9 / bandwidth:.0%} of the {bandwidth:.1f} GB/s this machine reads")


if __name__ == "__main__":
    main()
