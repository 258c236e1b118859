"""A model of real size, kvlm's defaults beside llama.cpp on the same file in the same run: start time (cold: the
file out of the OS page cache; warm: in it), peak and steady resident memory, 512-token prefill and batch-1
decode.

    python -m bench.big_model [--shape qwen2.5-7b] [--model GGUF] [--tokens 32] [--repeats 2]

The file (unless --model names one) is made by bench/big_model_file.py: a real model's shapes and random weights,
quantized to Q4_K_M (gpt-oss: MXFP4_MOE) by llama.cpp's own quantizer, cached in $KVLM_HOME/bench. Random
weights say nothing of quality; memory, loading and speed are what a real file of that shape gets.

Every measurement runs in a child process of its own (llama.cpp's threads spin after a call and would slow kvlm
beside them), engines interleaved. A first kvlm child loads the model once, untimed, so that its tiles file
(kvlm.loader.tile_cache) is there as it is for every start after a user's first. In a child: the engine loads the
file (for "cold", after its pages, and every kvlm tiles file's, were evicted from the page cache with
posix_fadvise) and makes a context of --n-ctx cells; "start" is load + context. Then one
512-token prompt in one batch (prefill tokens/s), then --tokens greedy tokens one at a time after it (decode
tokens/s). Peak resident memory is the child's VmHWM; steady is its resident memory after decoding. llama.cpp
maps the file, so its resident memory counts the file's pages (shared with the page cache) as well as its
repacked copy of the weights.
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
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.common import machine_line, markdown_table  # noqa: E402
from bench.multi_sequence import KvlmContext  # noqa: E402
from kvlm import load_model  # noqa: E402
from kvlm.loader.memory_plan import MemoryRequest, peak_resident_bytes, resident_bytes  # noqa: E402
from kvlm.loader.tile_cache import SUFFIX as TILES_SUFFIX  # noqa: E402
from kvlm.loader.tile_cache import WRITER as TILES_WRITER  # noqa: E402
from kvlm.loader.tile_cache import cache_directory  # noqa: E402
from kvlm.memory.kv_store import AUTO, resolve_kv_dtype  # noqa: E402

KVLM, LLAMA = "kvlm defaults", "llama.cpp"
PREFILL_TOKENS = 512
SHORT_PROMPT = 16  # each of the parallel sequences' prompt
MEASURES = ("start s", "peak GiB", "steady GiB", "prefill tok/s", "decode tok/s")


def evict(path: Path) -> None:
    """Drop the file's pages, and every kvlm tiles file's, from the OS page cache (clean pages of a file nobody maps
    go): a cold start reads the model from disk, whichever file it reads it from."""
    tiles = cache_directory()
    for file in [path, *(tiles.glob("*" + TILES_SUFFIX) if tiles is not None and tiles.is_dir() else [])]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(open_engine, make_context, vocab: int, tokens: int, sequences: int) -> dict:
    """Start (open_engine() and a context of one sequence), prefill of PREFILL_TOKENS tokens, then `tokens` greedy
    tokens one at a time; with `sequences`, then that many sequences decoding together in a context of their own."""
    started = time.perf_counter()
    engine = open_engine()
    ctx = make_context(engine, 1)
    start = time.perf_counter() - started
    prompt = [(7919 * i) % (vocab - 1000) + 500 for i in range(PREFILL_TOKENS)]  # plain tokens, no specials
    started = time.perf_counter()
    ctx.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [i == len(prompt) - 1 for i in range(len(prompt))])
    token = ctx.greedy(0)
    prefill = time.perf_counter() - started
    generated, started = [token], time.perf_counter()
    for position in range(len(prompt), len(prompt) + tokens):
        ctx.decode([generated[-1]], [position], [0], [True])
        generated.append(ctx.greedy(0))
    decode = time.perf_counter() - started
    result = {"start s": start, "prefill tok/s": len(prompt) / prefill, "decode tok/s": tokens / decode,
              "steady GiB": resident_bytes() / 2**30, "peak GiB": peak_resident_bytes() / 2**30,
              "tokens": generated[:8]}
    if sequences:
        ctx.close()
        result[f"{sequences} seqs tok/s"] = parallel_decode(make_context(engine, sequences), vocab, tokens, sequences)
    return result


def parallel_decode(ctx, vocab: int, tokens: int, sequences: int) -> float:
    """Aggregate tokens/s of `sequences` sequences (prompts of SHORT_PROMPT tokens, prefilled in one batch first)
    each decoding `tokens` greedy tokens, one token per sequence per step."""
    prompts = [[(7919 * (i + 31 * s)) % (vocab - 1000) + 500 for i in range(SHORT_PROMPT)] for s in range(sequences)]
    ctx.decode([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))],
               [s for s, p in enumerate(prompts) for _ in p], [i == len(p) - 1 for p in prompts for i in range(len(p))])
    last = [ctx.greedy(s) for s in range(sequences)]
    seq_ids, outputs = list(range(sequences)), [True] * sequences
    started = time.perf_counter()
    for step in range(tokens):
        ctx.decode(last, [SHORT_PROMPT + step] * sequences, seq_ids, outputs)
        last = [ctx.greedy(s) for s in range(sequences)]
    return sequences * tokens / (time.perf_counter() - started)


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    path = Path(args.child_path)
    if args.child_cold:
        evict(path)
    if args.child == LLAMA:
        lib = llama.import_llama_cpp()
        with llama.llama_threads_free(lib):
            def open_engine():
                return llama.LlamaCpp(lib, path, args.threads, args.child_extra_bufts == "on")

            def make_context(engine, n_seq: int):  # one pool for all sequences, as kvlm's
                return engine.context(args.n_ctx, n_seq, unified=n_seq > 1)
            result = measure(open_engine, make_context, args.child_vocab, args.tokens, args.sequences)
    elif args.child_prepare:  # a first start: the model's tiles file written (if the cache has none) before timing
        started = time.perf_counter()
        load_model(str(path), progress=False, memory=MemoryRequest(n_ctx=args.n_ctx))
        loaded = time.perf_counter() - started
        TILES_WRITER.submit(lambda: None).result()
        result = {"load s": loaded, "tiles written s": time.perf_counter() - started - loaded}
    else:
        def open_engine():
            return load_model(str(path), progress=False,
                              memory=MemoryRequest(n_ctx=args.n_ctx, n_seq_max=max(1, args.sequences)))

        def make_context(model, n_seq: int):
            return KvlmContext(model, args.n_ctx, n_seq, resolve_kv_dtype(AUTO, model.decoder.dtype,
                                                                          model.decoder.quantized))
        result = measure(open_engine, make_context, args.child_vocab, args.tokens, args.sequences)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(label: str, path: Path, cold: bool, vocab: int, args: argparse.Namespace, extra_bufts: bool,
              prepare: bool = False) -> dict:
    command = [sys.executable, "-m", "bench.big_model", "--child", label, "--child-path", str(path),
               "--child-vocab", str(vocab), "--child-extra-bufts", "on" if extra_bufts else "off",
               "--threads", str(args.threads), "--n-ctx", str(args.n_ctx), "--tokens", str(args.tokens),
               "--sequences", str(args.sequences)] + (["--child-prepare"] if prepare else [])
    # Every core this process started with: torch's OpenMP pinned this one's main thread (and so the children it
    # forks) to one core.
    done = subprocess.run(command + (["--child-cold"] if cold else []), capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent,
                          preexec_fn=lambda: os.sched_setaffinity(0, kvlm.startup.START_CPUS))  # noqa: PLW1509
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{label} child failed ({done.returncode}): {done.stderr.strip()[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def model_file(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from bench.big_model_file import default_path, make_big_model

    return make_big_model(default_path(args.shape), shape=args.shape)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-7b", help="bench/big_model_file.py's shape (default qwen2.5-7b)")
    parser.add_argument("--model", default=None, help="a GGUF file instead of the made one")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded one at a time")
    parser.add_argument("--repeats", type=int, default=2, help="child processes per setting and start (median)")
    parser.add_argument("--n-ctx", type=int, default=4096, help="both engines' context size")
    parser.add_argument("--sequences", type=int, default=0,
                        help="also decode this many sequences together (e.g. 32), in a context of their own")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    llama.add_extra_bufts_option(parser)
    parser.add_argument("--no-llama", action="store_true", help="run kvlm only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-path", help=argparse.SUPPRESS)
    parser.add_argument("--child-vocab", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-cold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-extra-bufts", default="on", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = parser().parse_args()
    if args.child:
        child(args)
    else:
        compare(args)


def compare(args: argparse.Namespace) -> dict:
    """Prints the comparison; returns the medians by (engine, cold)."""
    from kvlm.loader.gguf_file import read_gguf_config

    path = model_file(args)
    vocab = read_gguf_config(path).vocab_size
    lib = None if args.no_llama else llama.import_llama_cpp()
    extra_bufts = llama.resolve_extra_bufts(args.llama_extra_bufts, path) if lib is not None else False
    labels = [KVLM] + ([LLAMA] if lib is not None else [])
    limits = machine_limits(args.threads)  # before the engines, on the quiet machine
    runs: dict[tuple[str, bool], list[dict]] = {(label, cold): [] for label in labels for cold in (True, False)}
    parallel = f"{args.sequences} seqs tok/s"
    measures = MEASURES + ((parallel,) if args.sequences else ())
    first = run_child(KVLM, path, False, vocab, args, extra_bufts, prepare=True)
    print(f"kvlm's first start: load {first['load s']:.2f} s, then its tiles file written in "
          f"{first['tiles written s']:.2f} s (nothing to write where the cache had it)", flush=True)
    for repeat in range(args.repeats):  # engines interleaved: a slow phase of the machine hits both
        for label in labels:
            for cold in (True, False):
                result = run_child(label, path, cold, vocab, args, extra_bufts)
                runs[label, cold].append(result)
                print(f"run {repeat + 1}, {label}, {'cold' if cold else 'warm'}: "
                      + ", ".join(f"{m} {result[m]:.2f}" for m in measures) + f", tokens {result['tokens']}",
                      flush=True)
    median = {key: {m: statistics.median(r[m] for r in rs) for m in measures} for key, rs in runs.items()}
    print(f"\n{machine_line()}; {args.threads} threads for both engines")
    print(f"GGUF: {path.name} ({path.stat().st_size / 2**30:.2f} GiB); n_ctx {args.n_ctx}; prefill {PREFILL_TOKENS} "
          f"tokens in one batch; decode {args.tokens} tokens at batch 1 after it; "
          + (llama.setup_note(lib, extra_bufts) if lib is not None else "llama.cpp not run"))
    print(f"median of {args.repeats} child processes per setting\n")
    header = ["engine", "cold start s", "warm start s", "peak GiB", "steady GiB", "prefill tok/s", "decode tok/s"]
    header += [f"{args.sequences} sequences tok/s"] if args.sequences else []
    rows = [[label, f"{median[label, True]['start s']:.1f}", f"{median[label, False]['start s']:.1f}",
             f"{median[label, False]['peak GiB']:.2f}", f"{median[label, False]['steady GiB']:.2f}",
             f"{median[label, False]['prefill tok/s']:.1f}", f"{median[label, False]['decode tok/s']:.2f}"]
            + ([f"{median[label, False][parallel]:.2f}"] if args.sequences else []) for label in labels]
    print(markdown_table(header, rows))
    if lib is not None:
        ours, theirs = median[KVLM, False], median[LLAMA, False]
        print(f"\nkvlm / llama.cpp: prefill {ours['prefill tok/s'] / theirs['prefill tok/s']:.2f}x, decode "
              f"{ours['decode tok/s'] / theirs['decode tok/s']:.2f}x, warm start "
              f"{ours['start s'] / theirs['start s']:.2f}x (time), cold start "
              f"{median[KVLM, True]['start s'] / median[LLAMA, True]['start s']:.2f}x (time), peak memory "
              f"{ours['peak GiB'] / theirs['peak GiB']:.2f}x"
              + (f", {args.sequences} sequences {ours[parallel] / theirs[parallel]:.2f}x" if args.sequences else ""))
    print_limits(path, limits, {label: median[label, False] for label in labels})
    return median


def machine_limits(threads: int) -> dict[str, float]:
    """The int8 multiply-add peak (bench.arith_peak) and the memory read bandwidth (bench.memory_bandwidth) on
    `threads` threads: the ceilings under prefill and batch-1 decode."""
    from bench.arith_peak import peaks, products_peak
    from bench.memory_bandwidth import read_gb_per_s

    torch.set_num_threads(threads)
    mix, peak = products_peak(peaks(threads))
    return {"int8": peak, "int8 mix": mix, "GB/s": read_gb_per_s(2.0, 5)}


def print_limits(path: Path, limits: dict[str, float], warm: dict[str, dict]) -> None:
    """Each engine's prefill as multiply-adds per second and a share of the int8 peak, and its decode as bytes
    read per second and a share of the measured bandwidth."""
    from bench.arith_peak import token_costs

    multiply_adds, read = token_costs(path)
    print(f"\nmachine: int8 peak {limits['int8'] / 1e9:.1f} G multiply-adds/s ({limits['int8 mix']}), read bandwidth "
          f"{limits['GB/s']:.1f} GB/s; a token: {multiply_adds / 1e9:.2f} G multiply-adds in a prompt, "
          f"{read / 1e9:.2f} GB read in decode")
    for label, result in warm.items():
        achieved = result["prefill tok/s"] * multiply_adds
        streamed = result["decode tok/s"] * read / 1e9
        print(f"{label}: prefill {achieved / 1e9:.1f} G multiply-adds/s = {achieved / limits['int8']:.0%} of the peak; "
              f"decode {streamed:.1f} GB/s = {streamed / limits['GB/s']:.0%} of the bandwidth")


if __name__ == "__main__":
    main()
