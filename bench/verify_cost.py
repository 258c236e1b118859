"""What verifying guesses costs on this CPU: one `Context.decode` of n rows of one sequence (a last token and n - 1
guesses, logits on every row) after a 300-token context, against one row; kvlm's defaults.

    python -m bench.verify_cost [--model NAME] [--rows 1 2 3 5 9] [--repeats 15]

The best of `--repeats` per row count (the VM is noisy); the rows are removed after each (seq_rm), so every
measurement starts from the same context.
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OpenMP's threads before they start

import argparse
import time

from bench.common import add_model_option, machine_line, markdown_table, model_gguf
from kvlm import Batch, Context, load_model

CONTEXT = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    model = load_model(str(model_gguf(args.model)), progress=False)
    context = Context(model, n_ctx=1024, n_seq_max=1, kv_dtype="f16")
    context.decode(Batch(tokens=list(range(100, 100 + CONTEXT)), seq_ids=[0] * CONTEXT))
    rows = []
    for n in args.rows:
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            context.decode(Batch(tokens=[500] * n, pos=list(range(CONTEXT, CONTEXT + n)), seq_ids=[0] * n,
                                 logits=[True] * n))
            best = min(best, time.perf_counter() - started)
            context.memory.seq_rm(0, CONTEXT, -1)
        rows.append([n, f"{best * 1e3:.2f}"])
    base = float(rows[0][1])
    for row in rows:
        row.append(f"{float(row[1]) / base:.2f}x")
    print(f"\n{args.model}, {CONTEXT}-token context, best of {args.repeats}; {machine_line()}\n")
    print(markdown_table(["rows", "ms", "vs the first row count"], rows))


if __name__ == "__main__":
    main()
