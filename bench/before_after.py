"""kvlm's defaults in this checkout against another checkout of kvlm (the code before a change), in the same run:
512-token prefill, batch-1 decode and 32 sequences decoding together, per model, from bench.big_model's children
(each measurement a process of its own), the two checkouts taking turns.

    git worktree add /tmp/before <commit>
    python -m bench.before_after --before /tmp/before [--models smollm2-135m-instruct ...] [--repeats 3]
    python -m bench.before_after --before /tmp/before --models ~/.cache/kvlm/bench/qwen2.5-7b-shaped-q4_k_m.gguf \
        --tokens 16 --sequences 0 --repeats 2    # bench.big_model_file's 7B shape: prefill and batch-1 decode

Prints each checkout's median and the ratio after / before. The other checkout is imported from its own folder (its
children run there), so it needs no install of its own; both use this venv's packages.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import machine_line, markdown_table
from kvlm.loader.fetch import resolve_model
from kvlm.loader.gguf_file import read_gguf_config

HERE = Path(__file__).resolve().parent.parent
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
MEASURES = ("prefill tok/s", "decode tok/s")  # and "N seqs tok/s" with --sequences N


def run_child(checkout: Path, path: Path, vocab: int, args: argparse.Namespace) -> dict:
    """bench.big_model's kvlm child, run from `checkout` (so that checkout's kvlm is the one imported)."""
    command = [sys.executable, "-m", "bench.big_model", "--child", "kvlm defaults", "--child-path", str(path),
               "--child-vocab", str(vocab), "--threads", str(args.threads), "--n-ctx", "4096",
               "--tokens", str(args.tokens), "--sequences", str(args.sequences)]
    environment = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=checkout, env=environment, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{checkout} child failed ({done.returncode}): {done.stderr.strip()[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout of kvlm")
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="children per checkout and model (median)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded one at a time")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--sequences", type=int, default=32, help="sequences decoding together (0: not measured)")
    args = parser.parse_args()
    measures = MEASURES + ((f"{args.sequences} seqs tok/s",) if args.sequences else ())
    checkouts = {"before": args.before.resolve(), "after": HERE}
    print(machine_line(), flush=True)
    rows = []
    for name in args.models:
        path = resolve_model(name)
        vocab = read_gguf_config(path).vocab_size
        results: dict[str, list[dict]] = {label: [] for label in checkouts}
        for _ in range(args.repeats):  # the checkouts take turns, so drift on the machine hits both
            for label, checkout in checkouts.items():
                results[label].append(run_child(checkout, path, vocab, args))
        for measure in measures:
            before, after = (statistics.median(r[measure] for r in results[label]) for label in checkouts)
            rows.append([Path(name).name, measure, f"{before:.1f}", f"{after:.1f}", f"{after / before:.2f}x"])
            print(" | ".join(rows[-1]), flush=True)
    print(markdown_table(["model", "measure", "before", "after", "after / before"], rows))


if __name__ == "__main__":
    main()
