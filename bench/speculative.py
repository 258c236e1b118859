"""Speculative decoding on kvlm's defaults beside llama.cpp, each run in a process of its own.

    python -m bench.speculative [--model NAME] [--tokens 256] [--repeats 2] [--only batch1|batch32|draft]

- batch 1 on three kinds of chat prompts: code editing and document rewriting (the answer repeats much of the
  prompt; greedy) and free text (sampled at temperature 0.7 with a seed, so that it repeats little: greedy small
  models loop): kvlm without speculation, kvlm with prompt lookup
  (`{"method": "ngram", "num_speculative_tokens": 8}`, adaptive as by default), and llama.cpp without speculation;
- 32 concurrent requests (the edit prompts, varied), prompt lookup on and off: aggregate tokens/s;
- `--only draft`: Qwen2.5-Coder-1.5B with the 0.5B as its draft on the code prompts, left to decide and forced.

Decode speed is a request's tokens after the first over the time from its first token to its last (prefill
excluded), the best of `--repeats`. Every run generates until EOS or `--tokens`; llama.cpp then decodes as many
tokens as kvlm's unspeculated run did (greedy, the same prompt ids: a token costs it the same however chosen). Outputs with and without speculation are
compared token for token.
"""
from __future__ import annotations

from bench.llama_cpp_driver import import_llama_cpp, llama_engine  # noqa: I001 - before kvlm (CPU mask)

import argparse
import json
import subprocess
import sys
import time

from bench.common import add_model_option, machine_line, markdown_table, model_gguf

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def load_items(path):
    with open(path) as f:
        data = json.load(f)
    items = []
    for entry in data:
        items.append(Item(entry["name"], entry["price"], entry["quantity"]))
    return items


def total(items):
    result = 0.0
    for item in items:
        result += item.price * item.quantity
    return result


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best


if __name__ == "__main__":
    items = load_items("items.json")
    print("total:", total(items))
    print("cheapest:", cheapest(items).name)
'''

DOCUMENT = ("The city council met on Tuesday evening to discuss the new library budget. After a long debate, the "
            "members agreed to extend the opening hours on weekends and to buy more books for children. The mayor "
            "said that the library is one of the most important places in the city, because it is open to "
            "everyone and it costs nothing to use. Some members asked where the money would come from. The "
            "finance officer explained that part of the money would come from the parks budget, which was not "
            "fully spent last year, and the rest from a small grant given by the regional government. The "
            "council will vote on the final plan next month, after the public has had a chance to comment.")

PROMPTS = {
    "code edit": [f"Rename the class Item to Product everywhere in this code and output the whole file:\n\n{CODE}",
                  f"Add a docstring to each function of this code and output the whole file:\n\n{CODE}"],
    "doc rewrite": [f"Rewrite this text in British English spelling, changing nothing else:\n\n{DOCUMENT}",
                    f"Copy this text and put each sentence on its own line:\n\n{DOCUMENT}"],
    "free text": ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
                  "Explain how a bicycle stays upright while it moves, for a ten-year-old."],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


# --- workers (each in a process of its own) ------------------------------------------------------------------------

def kvlm_worker(args) -> dict:
    import kvlm  # noqa: F401
    from kvlm import LLM, SamplingParams

    speculative = json.loads(args.speculative) if args.speculative else None
    if speculative and speculative.get("model"):
        speculative["model"] = str(model_gguf(speculative["model"]))
    # (no prefix cache: a repeat would reuse the prompt's cells, and compute its last token alone, as decode does,
    # which changes the rounding of what follows: every repeat does the same work, and runs can be compared)
    llm = LLM(str(model_gguf(args.model)), max_num_seqs=max(args.batch, 1), n_ctx=4096,
              enable_prefix_caching=False, speculative_config=speculative)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in json.loads(args.prompts)]
    if args.batch > 1:
        prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    # free text is sampled (seeded, so the runs agree token for token): greedy small models loop, and repeat
    params = SamplingParams(max_tokens=args.tokens, temperature=0.7 if args.sampled else 0.0, seed=0)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    best: dict = {}
    for _ in range(args.repeats):
        if args.batch > 1:
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            result = {"tokens_per_s": sum(len(o.token_ids) for o in outputs) / elapsed,
                      "token_ids": [o.token_ids for o in outputs]}
        else:
            per_prompt = []
            for prompt in prompts:
                output = llm.generate([prompt], params, use_tqdm=False)[0]
                per_prompt.append((output.token_ids, output.decode_seconds, output.speculation))
            decoded = sum(len(ids) - 1 for ids, _, _ in per_prompt)
            result = {"tokens_per_s": decoded / sum(s for _, s, _ in per_prompt),
                      "token_ids": [ids for ids, _, _ in per_prompt], "prompt_ids": prompts}
        if result["tokens_per_s"] > best.get("tokens_per_s", 0.0):
            best = result
    if llm.engine.speculator is not None:
        best["speculative"] = llm.engine.speculator.stats.to_json()
    return best


def llama_worker(args) -> dict:
    lib = import_llama_cpp()
    if lib is None:
        return {}
    prompts, lengths = json.loads(args.prompts), json.loads(args.lengths)
    best = 0.0
    with llama_engine(lib, model_gguf(args.model), threads=2, extra_bufts=True) as engine:
        for _ in range(args.repeats):
            decoded, seconds = 0, 0.0
            for prompt, n_tokens in zip(prompts, lengths):
                context = engine.context(4096, 1)
                context.decode(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
                token, position = context.greedy(0), len(prompt)
                started = time.perf_counter()
                for _ in range(n_tokens - 1):
                    context.decode([token], [position], [0], [True])
                    token, position = context.greedy(0), position + 1
                seconds += time.perf_counter() - started
                decoded += n_tokens - 1
                context.close()
            best = max(best, decoded / seconds)
    return {"tokens_per_s": best}


# --- the driver ------------------------------------------------------------------------------------------------------

def run_worker(kind: str, **options) -> dict:
    command = [sys.executable, "-m", "bench.speculative", "--worker", kind]
    for key, value in options.items():
        command += [f"--{key.replace('_', '-')}", value if isinstance(value, str) else json.dumps(value)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def batch1(args) -> None:
    rows = []
    for name, prompts in PROMPTS.items():
        common = dict(model=args.model, prompts=json.dumps(prompts), tokens=str(args.tokens),
                      repeats=str(args.repeats), batch="1", sampled=str(name == "free text"))
        plain = run_worker("kvlm", **common)
        spec = run_worker("kvlm", **common, speculative=json.dumps(NGRAM))
        lengths = [len(ids) for ids in plain["token_ids"]]
        llama = run_worker("llama", model=args.model, prompts=json.dumps(plain["prompt_ids"]),
                           lengths=json.dumps(lengths), repeats=str(args.repeats))
        stats = spec["speculative"]
        same = spec["token_ids"] == plain["token_ids"]
        rows.append([name, sum(lengths), f"{plain['tokens_per_s']:.1f}", f"{spec['tokens_per_s']:.1f}",
                     f"{llama.get('tokens_per_s', 0.0):.1f}", f"{spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x",
                     f"{spec['tokens_per_s'] / llama['tokens_per_s']:.2f}x" if llama else "-",
                     f"{stats['acceptance_rate']:.2f}", f"{stats['mean_acceptance_length']:.2f}", same])
        print(rows[-1], flush=True)
    print(f"\nbatch 1, {args.model}, greedy, up to {args.tokens} tokens, best of {args.repeats}; prompt lookup "
          f"{json.dumps(NGRAM)}; {machine_line()}\n")
    print(markdown_table(["prompts", "tokens", "kvlm tok/s", "kvlm + ngram tok/s", "llama.cpp tok/s",
                          "ngram / kvlm", "ngram / llama.cpp", "acceptance", "mean length", "same tokens"], rows))


def batch32(args) -> None:
    prompts = [p + f"\n\n(Request {i}.)" for i, p in enumerate(PROMPTS["code edit"] + PROMPTS["doc rewrite"])]
    common = dict(model=args.model, prompts=json.dumps(prompts), tokens=str(args.tokens), repeats=str(args.repeats),
                  batch="32")
    plain = run_worker("kvlm", **common)
    spec = run_worker("kvlm", **common, speculative=json.dumps(NGRAM))
    print(f"\n32 concurrent requests, {args.model}: without {plain['tokens_per_s']:.1f} tok/s, prompt lookup "
          f"{spec['tokens_per_s']:.1f} tok/s ({spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x), "
          f"acceptance {spec['speculative']['acceptance_rate']:.2f}, rounds {spec['speculative']['num_drafts']}, "
          f"same tokens {spec['token_ids'] == plain['token_ids']}")


def draft(args) -> None:
    common = dict(model="qwen2.5-coder-1.5b-instruct", prompts=json.dumps(PROMPTS["code edit"]),
                  tokens=str(args.tokens), repeats=str(args.repeats), batch="1")
    plain = run_worker("kvlm", **common)
    rows = []
    for label, adaptive in (("left to decide", True), ("forced", False)):
        config = {"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4, "adaptive": adaptive}
        spec = run_worker("kvlm", **common, speculative=json.dumps(config))
        stats = spec["speculative"]
        rows.append([label, f"{plain['tokens_per_s']:.2f}", f"{spec['tokens_per_s']:.2f}",
                     f"{spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x", stats["num_draft_tokens"],
                     f"{stats['acceptance_rate']:.2f}", f"{stats['mean_acceptance_length']:.2f}",
                     spec["token_ids"] == plain["token_ids"]])
        print(rows[-1], flush=True)
    print(f"\nQwen2.5-Coder-1.5B Q4_K_M with the 0.5B Q4_K_M drafting (k 4), code prompts, batch 1; {machine_line()}\n")
    print(markdown_table(["draft", "without tok/s", "with tok/s", "ratio", "guesses", "acceptance", "mean length",
                          "same tokens"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", choices=("batch1", "batch32", "draft"), default=None)
    parser.add_argument("--worker", choices=("kvlm", "llama"), default=None, help=argparse.SUPPRESS)
    for hidden in ("prompts", "lengths", "speculative", "batch", "sampled"):
        parser.add_argument(f"--{hidden}", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.batch, args.sampled = int(args.batch or 1), args.sampled == "True"
        print(json.dumps((kvlm_worker if args.worker == "kvlm" else llama_worker)(args)))
        return
    for name, run in (("batch1", batch1), ("batch32", batch32), ("draft", draft)):
        if args.only in (None, name):
            run(args)


if __name__ == "__main__":
    main()
