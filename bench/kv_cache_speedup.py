"""Per-step decode time with the KV cache vs recomputing the whole sequence, at growing context.

    python -m bench.kv_cache_speedup [--contexts 64 256 512 1024 2048] [--dtype float32]
"""
from __future__ import annotations

import argparse

from bench.common import (
    add_model_option, machine_line, markdown_table, median_seconds, model_gguf, model_label, plot_path,
)
from kvlm import Batch, Context, DecodeStatus
from kvlm.loader.load import load_model


def single_sequence(model, n_ctx: int) -> Context:
    """As kvlm.runtime.generate sizes it: one sequence, any batch up to n_ctx tokens in one micro-batch."""
    return Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=1)


def decode_ok(ctx: Context, tokens: list[int]) -> None:
    status = ctx.decode(Batch.for_sequence(tokens))
    if status != DecodeStatus.OK:
        raise RuntimeError(f"decode failed with {status.name}: {ctx.last_error}")


def step_times(model, context: int, repeats: int) -> tuple[float, float]:
    """Seconds for one new token after `context` tokens: cached decode, and full recomputation.

    The two steps of kvlm.runtime.generate: one token per batch, and (--no-cache) clear the memory, decode it all.
    """
    tokens = [(7 * i) % 1000 + 100 for i in range(context)]
    cached_ctx = single_sequence(model, context + repeats + 1)
    decode_ok(cached_ctx, tokens)
    cached = median_seconds(lambda: decode_ok(cached_ctx, [42]), repeats)
    scratch = single_sequence(model, context + 1)

    def recompute() -> None:
        scratch.memory.clear()
        decode_ok(scratch, tokens + [42])

    uncached = median_seconds(recompute, max(2, repeats // 8))
    return cached, uncached


def plot(rows: list[list[object]], title_model: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(contexts, [r[1] for r in rows], "o-", label="with KV cache")
    ax.plot(contexts, [r[2] for r in rows], "s-", label="recompute (no cache)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens already in the sequence)")
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"kvlm decode step, {title_model}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_option(parser)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024, 2048])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=16)
    args = parser.parse_args()
    path = model_gguf(args.model)
    model = load_model(str(path), args.dtype)
    rows = []
    for context in args.contexts:
        cached, uncached = step_times(model, context, args.repeats)
        rows.append([context, cached * 1e3, uncached * 1e3, uncached / cached])
        print(f"context {context}: cached {cached * 1e3:.2f} ms, recompute {uncached * 1e3:.1f} ms, "
              f"{uncached / cached:.1f}x", flush=True)
    print(f"\n{machine_line()}, dtype {args.dtype}\n")
    print(markdown_table(["context", "cached ms/token", "recompute ms/token", "speed-up"], rows))
    plot(rows, model_label(path), plot_path("kv_cache_speedup", args.model))
    print(f"\nplot: {plot_path('kv_cache_speedup', args.model)}")


if __name__ == "__main__":
    main()
