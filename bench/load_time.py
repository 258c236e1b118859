"""Load time of a cached model to ready, and time to first token: kvlm (per dtype setting) vs llama.cpp, one run.

    python -m bench.load_time [--model NAME_OR_GGUF] [--repeats 3] [--n-ctx 4096] [--threads N]

Every measurement runs in a fresh child process, so each is a cold start of the engine (imports of torch, kvlm and
llama_cpp are done before the clock starts) with the GGUF in the OS page cache (an untimed llama.cpp load reads it
once first). In the child:

- load: kvlm `load_model(path, dtype, quant=...)`: the file's header, its memory plan, its tensors read one at a
  time into their kernels' form (a quantized file's blocks as they are, dense bf16 copies where the plan has room),
  its tokenizer; after a first start, the matrices kept in tiles are mapped from the tiles file it wrote
  (kvlm.loader.tile_cache; models with less than 128 MiB of them have none). On a machine's first start kvlm
  also builds its native kernels ("first start": each such child gets an empty $KVLM_HOME, so it builds them and
  writes the tiles file; the other kvlm rows find them there). llama.cpp `llama_model_load_from_file` with its defaults (mmap, extra buffer
  types as --llama-extra-bufts resolves them).
- context: kvlm `Context(n_ctx, n_batch = n_ubatch = 512, one sequence)`; llama.cpp `llama_init_from_model` with
  the same sizes. load + context = ready.
- first token: one decode of a short prompt (the same token ids for both engines) and the argmax of its last
  logits. "cold" is the first decode of the process (one-time kernel set-up included: what a user waits for after
  start-up); "warm" the median of 3 more on fresh contexts.

The parent prints the median over --repeats children of each number, and kvlm / llama.cpp ratios of the times
(above 1.00x kvlm takes longer).
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP pins the main thread.
from bench import llama_cpp_driver as llama  # noqa: I001

import kvlm  # noqa: E402,F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.common import add_model_option, machine_line, markdown_table, model_gguf  # noqa: E402
from bench.multi_sequence import KvlmContext  # noqa: E402
from kvlm import load_model  # noqa: E402
from kvlm.loader.gguf_reader import read_gguf_metadata  # noqa: E402
from kvlm.memory.kv_store import AUTO, resolve_kv_dtype  # noqa: E402
from kvlm.text.tokenizer import Tokenizer  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
WARM_REPEATS = 3
KVLM_SETUPS = [("kvlm defaults, first start", "auto", "auto"), ("kvlm defaults", "auto", "auto"),
               ("kvlm f32", "float32", None)]
FIRST_START = "kvlm defaults, first start"
LLAMA = "llama.cpp"
MEASURES = ("load", "context", "ready", "first token cold", "first token warm")


# --- one child process: one engine setting, timed ---------------------------------------------------------------

def first_token(ctx, prompt: list[int]) -> tuple[float, int]:
    """Seconds to decode the prompt in one batch and take the argmax of its last logits; and that token. Closes ctx."""
    n = len(prompt)
    try:
        started = time.perf_counter()
        ctx.decode(prompt, list(range(n)), [0] * n, [i == n - 1 for i in range(n)])
        token = ctx.greedy(0)
        return time.perf_counter() - started, token
    finally:
        ctx.close()


def timed_start(load, make_context, prompt: list[int]) -> tuple[object, dict[str, float | int]]:
    """load(), then make_context(engine) (the ready state), then the first token, cold and warm (fresh contexts)."""
    started = time.perf_counter()
    engine = load()
    loaded = time.perf_counter()
    ctx = make_context(engine)
    ready = time.perf_counter()
    cold, token = first_token(ctx, prompt)
    warm = [first_token(make_context(engine), prompt)[0] for _ in range(WARM_REPEATS)]
    return engine, {"load": loaded - started, "context": ready - loaded, "ready": ready - started,
                    "first token cold": cold, "first token warm": statistics.median(warm), "token": token}


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    path, prompt = Path(args.child_path), [int(t) for t in args.child_prompt.split(",")]
    if args.child == LLAMA:
        lib = llama.import_llama_cpp()
        with llama.llama_threads_free(lib):
            extra_bufts = args.child_extra_bufts == "on"
            engine, result = timed_start(lambda: llama.LlamaCpp(lib, path, args.threads, extra_bufts),
                                         lambda engine: engine.context(args.n_ctx, 1), prompt)
            engine.close()
    else:
        dtype, quant = {label: (dtype, quant) for label, dtype, quant in KVLM_SETUPS}[args.child]
        kv_dtype = lambda model: resolve_kv_dtype(args.kv_dtype, model.decoder.dtype, model.decoder.quantized)  # noqa: E731
        model, result = timed_start(lambda: load_model(str(path), dtype, quant=quant, progress=False),
                                    lambda model: KvlmContext(model, args.n_ctx, 1, kv_dtype(model)), prompt)
        result["kv_dtype"] = kv_dtype(model)
    print("RESULT " + json.dumps(result), flush=True)


# --- the parent: children, medians, tables -----------------------------------------------------------------------

def run_child(label: str, path: Path, prompt: list[int], args: argparse.Namespace, extra_bufts: bool) -> dict:
    command = [sys.executable, "-m", "bench.load_time", "--child", label, "--child-path", str(path),
               "--child-prompt", ",".join(map(str, prompt)), "--child-extra-bufts", "on" if extra_bufts else "off",
               "--threads", str(args.threads), "--n-ctx", str(args.n_ctx), "--kv-dtype", args.kv_dtype]
    with tempfile.TemporaryDirectory() as empty:
        home = empty if label == FIRST_START else args.warm_home
        # Every core this process started with: torch's OpenMP pinned this one's main thread (and so the children it
        # forks) to one core.
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                              env={**os.environ, "KVLM_HOME": home},
                              preexec_fn=lambda: os.sched_setaffinity(0, kvlm.startup.START_CPUS))  # noqa: PLW1509
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{label} child failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--repeats", type=int, default=3, help="child processes per setting (median)")
    parser.add_argument("--n-ctx", type=int, default=4096, help="context size of both engines' contexts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads and llama.cpp n_threads / n_threads_batch (default: torch's count)")
    parser.add_argument("--kv-dtype", default=AUTO, help="kvlm's KV cache dtype (auto: the model's dtype)")
    llama.add_extra_bufts_option(parser)
    parser.add_argument("--no-llama", action="store_true", help="run kvlm only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-path", help=argparse.SUPPRESS)
    parser.add_argument("--child-prompt", help=argparse.SUPPRESS)
    parser.add_argument("--child-extra-bufts", default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as warm_home:
        args.warm_home = warm_home
        compare(args)


def compare(args: argparse.Namespace) -> None:
    path = model_gguf(args.model)
    prompt = Tokenizer.from_gguf_metadata(read_gguf_metadata(path)).encode(PROMPT)
    lib = None if args.no_llama else llama.import_llama_cpp()
    labels = [label for label, _, _ in KVLM_SETUPS] + ([LLAMA] if lib is not None else [])
    extra_bufts = llama.resolve_extra_bufts(args.llama_extra_bufts, path) if lib is not None else False
    if lib is not None:
        run_child(LLAMA, path, prompt, args, extra_bufts)  # untimed: the GGUF into the page cache
    for label, _, _ in KVLM_SETUPS[1:]:
        run_child(label, path, prompt, args, extra_bufts)  # untimed: builds the native kernels in the warm home
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for repeat in range(args.repeats):  # settings interleaved, so slow phases of a noisy machine hit all of them
        for label in labels:
            result = run_child(label, path, prompt, args, extra_bufts)
            runs[label].append(result)
            print(f"run {repeat + 1}, {label}: " + ", ".join(f"{m} {result[m]:.3f} s" for m in MEASURES)
                  + f", first token id {result['token']}", flush=True)

    median = {label: {m: statistics.median(r[m] for r in runs[label]) for m in MEASURES} for label in labels}
    print(f"\n{machine_line()}; {args.threads} threads for both engines; "
          f"OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND')}")
    kv = {label: runs[label][0]["kv_dtype"] for label in labels if label != LLAMA}
    print(f"GGUF: {path.name} ({path.stat().st_size / 1e6:.0f} MB); prompt {len(prompt)} tokens; n_ctx {args.n_ctx}; "
          f"kvlm KV " + ", ".join(f"{label.removeprefix('kvlm ')} {dtype}" for label, dtype in kv.items())
          + "; " + (llama.setup_note(lib, extra_bufts) if lib is not None else "llama.cpp not run"))
    print(f"median of {args.repeats} child processes per setting; seconds\n")
    rows = [[label, *(median[label][m] for m in MEASURES)] for label in labels]
    print(markdown_table(["setting", "load s", "context s", "ready s", "first token cold s", "first token warm s"],
                         [[r[0], *(f"{v:.3f}" for v in r[1:])] for r in rows]))
    if lib is not None:
        print("\nkvlm / llama.cpp (time ratios: above 1.00x kvlm takes longer)\n")
        ratios = [[label, *(f"{median[label][m] / median[LLAMA][m]:.2f}x" for m in ("ready", "first token cold",
                                                                                    "first token warm"))]
                  for label in labels if label != LLAMA]
        print(markdown_table(["kvlm setting", "ready", "first token cold", "first token warm"], ratios))
        tokens = {label: {r["token"] for r in runs[label]} for label in labels}
        print("\nfirst token ids: " + ", ".join(f"{label} {sorted(ids)}" for label, ids in tokens.items()))


if __name__ == "__main__":
    main()
