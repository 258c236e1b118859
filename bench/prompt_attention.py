"""A prompt's attention, one layer: kvlm's native kernel (every token over its own run of cells, as a decode token
reads them: what keeps logits batch-invariant) against torch's fused kernel over the same rows (what prompts took
before), at the head shapes of SmolLM2, Qwen2.5-0.5B and Gemma 3 270M, over an f16 cache and float32 queries (torch
in float32), or with `--dtype bfloat16` bf16 queries over a bf16 cache (the defaults where the CPU has AVX512-BF16;
torch in bfloat16, as kvlm.model.attention.attention_dtype ran such prompts).

    python -m bench.prompt_attention [--tokens 512] [--repeats 7] [--dtype bfloat16]

Milliseconds per call, the median of repeats, the two taking turns.
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it pins OpenMP threads

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.common import machine_line, markdown_table  # noqa: E402
from kvlm.kernels import native_kernels  # noqa: E402
from kvlm.memory.view import TokenCells  # noqa: E402
from kvlm.model.ops import grouped_attention  # noqa: E402

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Qwen2.5-0.5B": (14, 2, 64), "Gemma 3 270M": (4, 1, 256)}  # heads, KV, dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the queries' dtype; bfloat16 with a bf16 cache, else an f16 one")
    args = parser.parse_args()
    q_dtype = getattr(torch, args.dtype)
    kv_dtype = torch.bfloat16 if q_dtype == torch.bfloat16 else torch.float16
    ops = native_kernels().layer_ops
    print(machine_line())
    rows = []
    for name, (n_head, n_kv, dim) in SHAPES.items():
        n = args.tokens
        q = torch.randn(n, n_head, dim).to(q_dtype)
        k, v = torch.randn(n, n_kv, dim).to(kv_dtype), torch.randn(n, n_kv, dim).to(kv_dtype)
        cells = TokenCells(torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.arange(1, n + 1))
        mask = torch.full((n, n), float("-inf")).triu(1)
        runs = {"native": lambda: ops.attention(q, (k, None), (v, None), cells, dim ** -0.5),
                "torch": lambda: grouped_attention(q, k.to(q.dtype), v.to(q.dtype), mask)}
        times: dict[str, list[float]] = {label: [] for label in runs}
        for _ in range(args.repeats + 1):
            for label, run in runs.items():
                started = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - started)
        native, torch_ms = (statistics.median(times[label][1:]) * 1e3 for label in runs)
        rows.append([name, f"{n_head}/{n_kv} x {dim}", n, f"{native:.2f}", f"{torch_ms:.2f}", f"{torch_ms / native:.2f}x"])
    print(markdown_table(["shape", "heads/KV x dim", "tokens", "native ms", "torch ms", "native speed-up"], rows))


if __name__ == "__main__":
    main()
