"""Aggregate decode throughput with many parallel sequences, and 512-token prefill: kvlm vs llama.cpp, in one run.

    python -m bench.multi_sequence [--model NAME_OR_GGUF] [--sequences 1 8 32 64] [--steps 32] [--threads N]

Decode: every sequence gets its own prompt (28-32 tokens cut from one English paragraph; both engines get the
same token ids). All prompts are prefilled (whole prompts packed into batches of at most 512 tokens), then a few
untimed warm-up steps run, then `--steps` timed steps; one step is one batch holding the next token of every
sequence (greedy: the argmax of that sequence's logits), every token an output. Aggregate tokens/s =
sequences x steps / elapsed, the batch building and the argmax included, for both engines.

Prefill: one 512-token prompt, one batch, only the last token an output; a fresh context each repeat (made
outside the timing), median of `--repeats`, after one untimed warm-up.

kvlm runs its defaults (what `load_model(path)` picks for this CPU: bfloat16 with the file's own quantization
where the CPU has native bf16, see kvlm.model.settings), bfloat16 with dense weights, and float32 (the reference).
Its KV cache is the one a user gets (--kv-dtype auto: bf16 for a bfloat16 model, f32 for float32). llama.cpp runs through llama-cpp-python's low-level C API
(llama_batch_init, llama_decode, llama_get_logits_ith) on the same GGUF, with the weights as stored (quantized),
its default F16 KV cache and flash-attention setting (auto), n_batch = n_ubatch = 512, and as many threads as
torch uses. Its default KV layout for several sequences is one stream per sequence (kv_unified = false); the
unified layout (kv_unified = true: one pool, attention over all of it) is measured too unless --llama-kv says
otherwise.

--model picks the GGUF (default: SmolLM2-135M, the model of RESULTS.md's tables). Batch-1 decode of 128 tokens
and 512-token prefill for another model, for example:

    python -m bench.multi_sequence --model qwen2.5-coder-0.5b-instruct --sequences 1 --steps 128 --llama-kv split
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP pins the main thread.
from bench import llama_cpp_driver as llama  # noqa: I001

import kvlm  # noqa: E402,F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    add_model_option, can_plot, machine_line, markdown_table, model_gguf, model_label, plot_path,
)
from bench.llama_cpp_driver import N_BATCH, N_UBATCH  # noqa: E402
from kvlm import Batch, Context, DecodeStatus, load_model  # noqa: E402
from kvlm.memory.kv_store import AUTO, resolve_kv_dtype  # noqa: E402

PROMPT_LENGTHS = (28, 29, 30, 31, 32)
PROMPT_STRIDE = 7  # sequence i's prompt starts at token 7 * i of the paragraph
WARMUP_STEPS = 2
SLACK = 8  # spare cells per sequence
CHECK_TOKENS = 8  # generated tokens compared between engines

PARAGRAPH = (
    "The river begins as a thin stream of melted snow high in the mountains, where the air is cold and the "
    "ground stays frozen for most of the year. In early summer the snow on the northern slopes softens, and "
    "water gathers in small pools between the rocks before it finds a path downhill. Shepherds who bring "
    "their flocks to the high meadows know every bend of this young river, because it decides where the "
    "animals can drink and where the grass will grow thick. Further down the valley the stream is joined by "
    "dozens of others, and by the time it reaches the first village it is wide enough to turn a mill wheel. "
    "For centuries the villagers ground their grain here, paid the miller in flour, and argued about who had "
    "the right to divert water into the fields during dry months. The old stone bridge that still stands at "
    "the center of the village was built after a flood carried away the wooden one, and the date of its "
    "completion is carved into the keystone above the middle arch. Below the village the valley opens into "
    "a broad plain. Farmers grow wheat, barley and sunflowers in long narrow strips, and in autumn the roads "
    "are crowded with tractors pulling trailers full of grain to the cooperative silos near the railway "
    "station. The river slows down on the plain, its water turns brown with silt, and it begins to wander in "
    "wide loops that change a little every spring. Engineers have tried several times to straighten it, "
    "building embankments and cutting new channels, but each major flood has undone part of their work. "
    "Birds depend on the wetlands that remain along the old loops. Herons stand motionless in the shallow "
    "water, storks build enormous nests on chimneys and electricity poles, and in the evening huge flocks "
    "of starlings wheel above the reeds before settling for the night. Scientists from the university in "
    "the city count the birds every year, and their records show which species are becoming rare and which "
    "are adapting to the new fields and canals. Near the coast the river splits into several arms that "
    "spread across a delta of islands, lagoons and salt marshes. Fishermen in flat wooden boats set their "
    "nets at dawn, while tourists in the summer rent bicycles and follow the dikes to watch the sunset over "
    "the sea. The river that started as a trickle of snowmelt ends as a slow, wide, patient body of water, "
    "carrying soil from the mountains to build new land where it meets the waves."
)


# --- prompts -------------------------------------------------------------------------------------------------

def make_prompts(paragraph_ids: list[int], n_seq: int) -> list[list[int]]:
    """Sequence i's prompt: PROMPT_LENGTHS[i % 5] tokens of the paragraph from token PROMPT_STRIDE * i (wrapping)."""
    room = len(paragraph_ids) - max(PROMPT_LENGTHS)
    prompts = []
    for i in range(n_seq):
        start = (PROMPT_STRIDE * i) % room
        prompts.append(paragraph_ids[start : start + PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]])
    return prompts


def long_prompt(paragraph_ids: list[int], n_tokens: int) -> list[int]:
    return [paragraph_ids[i % len(paragraph_ids)] for i in range(n_tokens)]


def decode_n_ctx(n_seq: int, steps: int) -> int:
    return n_seq * (max(PROMPT_LENGTHS) + 1 + WARMUP_STEPS + steps + SLACK)


# --- engines: a context that decodes a batch and gives the greedy token of its k-th output ---------------------

class KvlmContext:
    def __init__(self, model, n_ctx: int, n_seq: int, kv_dtype: str) -> None:
        self.ctx = Context(model, n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=N_UBATCH, n_seq_max=n_seq, kv_dtype=kv_dtype)

    def decode(self, tokens: list[int], pos: list[int], seq_ids: list[int], outputs: list[bool]) -> None:
        status = self.ctx.decode(Batch(tokens=tokens, pos=pos, seq_ids=seq_ids, logits=outputs))
        if status != DecodeStatus.OK:
            raise RuntimeError(f"kvlm decode failed: {status.name}: {self.ctx.last_error}")

    def greedy(self, k: int) -> int:
        return int(torch.argmax(self.ctx.get_logits_ith(k)))

    def close(self) -> None:
        del self.ctx


# --- the two measurements ----------------------------------------------------------------------------------------

def decode_throughput(make_context: Callable[[int, int], object], prompts: list[list[int]],
                      steps: int) -> tuple[float, list[list[int]]]:
    """Aggregate decode tokens/s over `steps` steps of one token per sequence; and every sequence's greedy tokens."""
    n_seq = len(prompts)
    ctx = make_context(decode_n_ctx(n_seq, steps), n_seq)
    try:
        generated: list[list[int]] = [[] for _ in range(n_seq)]
        chunk: list[int] = []
        for seq in range(n_seq + 1):  # prefill: whole prompts packed into batches of at most N_BATCH tokens
            if seq == n_seq or (chunk and sum(len(prompts[s]) for s in chunk) + len(prompts[seq]) > N_BATCH):
                tokens = [t for s in chunk for t in prompts[s]]
                pos = [p for s in chunk for p in range(len(prompts[s]))]
                seq_ids = [s for s in chunk for _ in prompts[s]]
                outputs = [p == len(prompts[s]) - 1 for s in chunk for p in range(len(prompts[s]))]
                ctx.decode(tokens, pos, seq_ids, outputs)
                for k, s in enumerate(chunk):
                    generated[s].append(ctx.greedy(k))
                chunk = []
            if seq < n_seq:
                chunk.append(seq)
        seq_ids = list(range(n_seq))
        outputs = [True] * n_seq

        def step() -> None:
            tokens = [generated[s][-1] for s in seq_ids]
            pos = [len(prompts[s]) + len(generated[s]) - 1 for s in seq_ids]
            ctx.decode(tokens, pos, seq_ids, outputs)
            for s in seq_ids:
                generated[s].append(ctx.greedy(s))

        for _ in range(WARMUP_STEPS):
            step()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - started
    finally:
        ctx.close()
    return n_seq * steps / elapsed, generated


def prefill_throughput(make_context: Callable[[int, int], object], prompt: list[int], repeats: int) -> float:
    """Tokens/s of one batch holding the whole prompt, fresh context each time; median of `repeats`, after a warm-up."""
    n = len(prompt)
    args = (prompt, list(range(n)), [0] * n, [i == n - 1 for i in range(n)])
    times = []
    for repeat in range(repeats + 1):
        ctx = make_context(max(1024, n + SLACK), 1)
        try:
            started = time.perf_counter()
            ctx.decode(*args)
            elapsed = time.perf_counter() - started
        finally:
            ctx.close()
        if repeat:  # the first is the warm-up
            times.append(elapsed)
    return n / statistics.median(times)


# --- output --------------------------------------------------------------------------------------------------------

def fmt(value: float | None) -> object:
    return "–" if value is None else float(value)


def ratio(a: float | None, b: float | None) -> object:
    return "–" if a is None or b is None else f"{a / b:.2f}x"


def plot(sequences: list[int], decode: dict[str, dict[int, float]], title_model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    styles = {"kvlm defaults": "o-", "kvlm bf16 dense": "D--", "kvlm f32": "s-", "llama.cpp": "^-",
              "llama.cpp unified KV": "v--"}
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, rates in decode.items():
        xs = [n for n in sequences if n in rates]
        if xs:
            ax.plot(xs, [rates[n] for n in xs], styles.get(label, "o-"), label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xticks(sequences)
    ax.set_xticklabels([str(n) for n in sequences])
    ax.set_xlabel("parallel sequences (one token each per decode step)")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title(f"Batched decode, {title_model}, {torch.get_num_threads()} threads")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_agreement(sequences: list[int], tokens: dict[str, dict[int, list[list[int]]]]) -> None:
    """How many of the first CHECK_TOKENS greedy tokens of sequences 0 and 1 agree between engines."""
    pairs = [("llama.cpp", "kvlm defaults"), ("llama.cpp", "kvlm f32"), ("kvlm f32", "kvlm defaults"),
             ("kvlm f32", "kvlm bf16 dense")]
    print(f"\nSanity check: of the first {CHECK_TOKENS} greedy tokens, how many match (sequence 0; sequence 1)")
    for n_seq in sequences:
        parts = []
        for a, b in pairs:
            if n_seq not in tokens.get(a, {}) or n_seq not in tokens.get(b, {}):
                continue
            counts = []
            for seq in range(min(2, n_seq)):
                x, y = tokens[a][n_seq][seq][:CHECK_TOKENS], tokens[b][n_seq][seq][:CHECK_TOKENS]
                counts.append(f"{sum(p == q for p, q in zip(x, y))}/{min(len(x), len(y))}")
            parts.append(f"{a} vs {b}: {'; '.join(counts)}")
        if parts:
            print(f"  {n_seq:>3} sequences: " + ", ".join(parts))


def kvlm_over_llama(decode: dict[str, dict[int, float]], prefill: dict[str, float], sequences: list[int],
                    prefill_tokens: int) -> str:
    """Every kvlm setting's rate over llama.cpp's (default KV layout), per measure: above 1.00x kvlm is faster."""
    rows = [[f"decode, {n} sequence{'s' if n > 1 else ''}",
             *(ratio(decode.get(label, {}).get(n), decode.get("llama.cpp", {}).get(n)) for label in KVLM_LABELS)]
            for n in sequences]
    rows.append([f"prefill, {prefill_tokens} tokens",
                 *(ratio(prefill.get(label), prefill.get("llama.cpp")) for label in KVLM_LABELS)])
    return markdown_table(["kvlm / llama.cpp", *KVLM_LABELS], rows)


# --- main --------------------------------------------------------------------------------------------------------

# label, dtype, quant, compiled graphs; the last runs only with --compile (each batch size costs a compile).
KVLM_SETUPS = [("kvlm defaults", "auto", "auto", False), ("kvlm bf16 dense", "bfloat16", None, False),
               ("kvlm f32", "float32", None, False), ("kvlm defaults, compiled", "auto", "auto", True)]
KVLM_LABELS = [label for label, *_ in KVLM_SETUPS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="prefill repeats (median)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads and llama.cpp n_threads / n_threads_batch (default: torch's count)")
    parser.add_argument("--kv-dtype", default=AUTO,
                        help="kvlm's KV cache dtype (auto: the model's, as users get it; llama.cpp keeps its f16)")
    parser.add_argument("--llama-kv", default="both", choices=("split", "unified", "both"),
                        help="llama.cpp KV layout: one stream per sequence (its default), one unified pool, or both")
    llama.add_extra_bufts_option(parser)
    parser.add_argument("--no-llama", action="store_true", help="run kvlm only")
    parser.add_argument("--compile", action="store_true",
                        help="also run kvlm's defaults through compiled graphs (load_model(compile=True))")
    args = parser.parse_args()
    if args.prefill_tokens > N_BATCH:
        parser.error(f"--prefill-tokens must be at most n_batch ({N_BATCH})")
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    sequences = sorted(set(args.sequences))
    path = model_gguf(args.model)

    decode: dict[str, dict[int, float]] = {}
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    prefill: dict[str, float] = {}
    kv_dtypes: dict[str, str] = {}
    paragraph_ids: list[int] = []
    for label, dtype, quant, compiled in KVLM_SETUPS:
        if compiled and not args.compile:
            continue
        model = load_model(str(path), dtype, quant=quant, compile=compiled)
        print(f"{label}: {model.decoder.describe()}", flush=True)
        if not paragraph_ids:
            paragraph_ids = model.tokenizer.encode(PARAGRAPH)
        kv_dtype = kv_dtypes[label] = resolve_kv_dtype(args.kv_dtype, model.decoder.dtype, model.decoder.quantized)
        make = lambda n_ctx, n_seq, model=model, kv=kv_dtype: KvlmContext(model, n_ctx, n_seq, kv)  # noqa: E731
        decode[label], tokens[label] = {}, {}
        for n_seq in sequences:
            rate, generated = decode_throughput(make, make_prompts(paragraph_ids, n_seq), args.steps)
            decode[label][n_seq], tokens[label][n_seq] = rate, generated
            print(f"{label}: {n_seq} sequences, decode {rate:.1f} tok/s", flush=True)
        prefill[label] = prefill_throughput(make, long_prompt(paragraph_ids, args.prefill_tokens), args.repeats)
        print(f"{label}: prefill {args.prefill_tokens} tokens, {prefill[label]:.1f} tok/s", flush=True)
        del make, model
        gc.collect()

    lib = None if args.no_llama else llama.import_llama_cpp()
    llama_note = "llama.cpp not run"
    if lib is not None:
        extra_bufts = llama.resolve_extra_bufts(args.llama_extra_bufts, path)
        layouts = {"split": [False], "unified": [True], "both": [False, True]}[args.llama_kv]
        with llama.llama_engine(lib, path, threads, extra_bufts) as engine:
            for unified in layouts:
                label = "llama.cpp unified KV" if unified else "llama.cpp"
                make = lambda n_ctx, n_seq, unified=unified: engine.context(n_ctx, n_seq, unified)  # noqa: E731
                decode[label], tokens[label] = {}, {}
                for n_seq in sequences:
                    rate, generated = decode_throughput(make, make_prompts(paragraph_ids, n_seq), args.steps)
                    decode[label][n_seq], tokens[label][n_seq] = rate, generated
                    print(f"{label}: {n_seq} sequences, decode {rate:.1f} tok/s", flush=True)
            prefill["llama.cpp"] = prefill_throughput(lambda n_ctx, n_seq: engine.context(n_ctx, n_seq),
                                                      long_prompt(paragraph_ids, args.prefill_tokens), args.repeats)
            print(f"llama.cpp: prefill {args.prefill_tokens} tokens, {prefill['llama.cpp']:.1f} tok/s", flush=True)
        gc.collect()
        llama_note = llama.setup_note(lib, extra_bufts)

    print_agreement(sequences, tokens)
    print(f"\n{machine_line()}; {threads} threads for both engines (torch.set_num_threads, llama.cpp n_threads and "
          f"n_threads_batch); OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND')}")
    print(f"GGUF: {path.name}; kvlm KV cache " + ", ".join(f"{label} {kv}" for label, kv in kv_dtypes.items())
          + f"; {llama_note}")
    print(f"decode: {args.steps} timed steps after {WARMUP_STEPS} warm-up steps, prompts of "
          f"{min(PROMPT_LENGTHS)}-{max(PROMPT_LENGTHS)} tokens, greedy\n")
    extra = "llama.cpp unified KV" in decode
    header = ["decode, aggregate tok/s", *KVLM_LABELS, "llama.cpp"]
    header += ["llama.cpp unified KV"] if extra else []
    header += ["kvlm defaults / llama.cpp"]
    rows = []
    for n_seq in sequences:
        get = lambda label: decode.get(label, {}).get(n_seq)  # noqa: E731
        row = [f"{n_seq} sequence{'s' if n_seq > 1 else ''}", *(fmt(get(label)) for label in KVLM_LABELS),
               fmt(get("llama.cpp"))]
        row += [fmt(get("llama.cpp unified KV"))] if extra else []
        rows.append(row + [ratio(get("kvlm defaults"), get("llama.cpp"))])
    print(markdown_table(header, rows))
    print()
    header = ["prefill, tok/s", *KVLM_LABELS, "llama.cpp", "kvlm defaults / llama.cpp"]
    print(markdown_table(header, [[f"{args.prefill_tokens}-token prompt, 1 sequence",
                                   *(fmt(prefill.get(label)) for label in KVLM_LABELS), fmt(prefill.get("llama.cpp")),
                                   ratio(prefill.get("kvlm defaults"), prefill.get("llama.cpp"))]]))
    print()
    print(kvlm_over_llama(decode, prefill, sequences, args.prefill_tokens))
    if can_plot():
        plot(sequences, decode, model_label(path), plot_path("multi_sequence", args.model))
        print(f"\nplot: {plot_path('multi_sequence', args.model)}")


if __name__ == "__main__":
    main()
