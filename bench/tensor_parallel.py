"""Tensor parallelism on this machine: `kvlm bench` with 1 and with N ranks, and llama.cpp on the same work, in
one run.

    python -m bench.tensor_parallel [--model qwen2.5-coder-0.5b-instruct] [--sizes 1 2] [--num-prompts 8]
                                    [--input-len 128] [--output-len 64]

The work (as vLLM's `vllm bench throughput`): `--num-prompts` random prompts of `--input-len` token ids (the same
ids for every engine, from kvlm.cli.benchmark.random_prompts), all submitted at once, each generating `--output-len`
tokens greedily with end-of-sequence ignored. Prefill tok/s = every prompt token over the time until every
prompt has its first generated token; decode tok/s = the other generated tokens over the rest of the time.

kvlm runs `kvlm bench --json` with its defaults (what a user gets) in a fresh process per size, on every core; with N ranks,
kvlm starts N - 1 more processes and gives each rank cores / N threads. llama.cpp runs through llama-cpp-python's
C API on the same GGUF in this process with as many threads as there are cores: one sequence per prompt (its
default split KV), prompts packed into batches of up to 512 tokens, then one batch per step holding every
sequence's next token.
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP pins the main thread.
from bench import llama_cpp_driver as llama  # noqa: I001

import kvlm  # noqa: E402,F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.common import machine_line, markdown_table, model_gguf, model_label  # noqa: E402
from bench.llama_cpp_driver import N_BATCH  # noqa: E402
from kvlm.cli.benchmark import random_prompts  # noqa: E402
from kvlm.loader.load import load_summary  # noqa: E402

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"  # 14 query heads, 2 KV heads: splits over 2 ranks
KVLM = str(Path(sys.executable).with_name("kvlm"))


def kvlm_bench(model: Path, size: int, args: argparse.Namespace) -> dict:
    command = [KVLM, "bench", "--model", str(model), "--tensor-parallel-size", str(size), "--json",
               "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--seed", str(args.seed)]
    # This process's main thread is pinned to one core by now (OpenMP); the child must see every core kvlm saw.
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          preexec_fn=lambda: os.sched_setaffinity(0, kvlm.startup.START_CPUS))  # noqa: PLW1509
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_bench(model: Path, prompts: list[list[int]], output_len: int, threads: int) -> dict:
    lib = llama.import_llama_cpp()
    extra_bufts = llama.resolve_extra_bufts("auto", model)
    n_prompts, input_len = len(prompts), len(prompts[0])
    with llama.llama_engine(lib, model, threads, extra_bufts) as engine:
        ctx = engine.context(n_prompts * _round_up(input_len + output_len, 256), n_prompts)
        try:
            started = time.perf_counter()
            last = _prefill(ctx, prompts)
            prefill_s = time.perf_counter() - started
            for step in range(output_len - 1):
                ctx.decode(last, [input_len + step] * n_prompts, list(range(n_prompts)), [True] * n_prompts)
                last = [ctx.greedy(k) for k in range(n_prompts)]
            elapsed = time.perf_counter() - started
        finally:
            ctx.close()
    return {"prefill_tokens_per_s": n_prompts * input_len / prefill_s, "elapsed_s": elapsed,
            "decode_tokens_per_s": n_prompts * (output_len - 1) / (elapsed - prefill_s),
            "requests_per_s": n_prompts / elapsed, "setup": llama.setup_note(lib, extra_bufts)}


def _prefill(ctx, prompts: list[list[int]]) -> list[int]:
    """Whole prompts packed into batches of at most N_BATCH tokens; each prompt's first generated token."""
    per_batch = max(1, N_BATCH // len(prompts[0]))
    first = []
    for start in range(0, len(prompts), per_batch):
        group = prompts[start : start + per_batch]
        tokens, pos, seqs, outputs = [], [], [], []
        for offset, prompt in enumerate(group):
            tokens += prompt
            pos += range(len(prompt))
            seqs += [start + offset] * len(prompt)
            outputs += [False] * (len(prompt) - 1) + [True]
        ctx.decode(tokens, pos, seqs, outputs)
        first += [ctx.greedy(k) for k in range(len(group))]
    return first


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a known model name or a .gguf file ({DEFAULT_MODEL})")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes for kvlm")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    args = parser.parse_args()
    path = model_gguf(args.model)
    results = {}
    for size in args.sizes:
        results[f"kvlm, {size} rank{'s' if size > 1 else ''}"] = run = kvlm_bench(path, size, args)
        print(f"kvlm -tp {size}: prefill {run['prefill_tokens_per_s']:.1f} tok/s, decode "
              f"{run['decode_tokens_per_s']:.1f} tok/s ({run['compute']})", flush=True)
    setup = "llama.cpp not run"
    if not args.no_llama:
        vocab = load_summary(str(path))[0].vocab_size
        prompts = random_prompts(vocab, args.num_prompts, args.input_len, args.seed)
        results["llama.cpp"] = run = llama_bench(path, prompts, args.output_len, os.cpu_count() or 1)
        setup = run["setup"]
        print(f"llama.cpp: prefill {run['prefill_tokens_per_s']:.1f} tok/s, decode "
              f"{run['decode_tokens_per_s']:.1f} tok/s", flush=True)
    print(f"\n{machine_line()}; GGUF {model_label(path)}; {setup}")
    print(f"{args.num_prompts} prompts x {args.input_len} random tokens, {args.output_len} generated each (greedy, "
          f"EOS ignored), all submitted at once\n")
    single = results.get("kvlm, 1 rank")
    llama_run = results.get("llama.cpp")
    rows = []
    for label, run in results.items():
        rows.append([label, f"{run['prefill_tokens_per_s']:.1f}", f"{run['decode_tokens_per_s']:.1f}",
                     f"{run['requests_per_s']:.2f}", _ratio(run, single), _ratio(run, llama_run)])
    print(markdown_table(["", "prefill tok/s", "decode tok/s", "requests/s", "decode vs kvlm 1 rank",
                          "decode vs llama.cpp"], rows))
    kvlm_runs = [run for label, run in results.items() if label.startswith("kvlm")]
    if len(kvlm_runs) > 1:
        same = sum(a == b for a, b in zip(kvlm_runs[0]["token_ids"], kvlm_runs[-1]["token_ids"]))
        print(f"\ngreedy outputs identical between {args.sizes[0]} and {args.sizes[-1]} ranks: {same} of "
              f"{args.num_prompts} (kvlm's defaults compute in bfloat16: sums added in another order may round "
              f"differently)")


def _ratio(run: dict, reference: dict | None) -> str:
    if reference is None or run is reference:
        return "-"
    return f"{run['decode_tokens_per_s'] / reference['decode_tokens_per_s']:.2f}x"


if __name__ == "__main__":
    main()
