"""One answer per greedy request: how many of 12 chat prompts get the same greedy text whatever the engine held.

For each model, the answers of an LLM without prefix caching, each prompt asked alone, are the reference; the same
prompts are then asked of an LLM with prefix caching (kvlm's default): one at a time, again (now from the prefix
cache), and all 12 in one batch. Each line counts the answers equal to the reference, token for token.

    python -m bench.greedy_consistency                       # SmolLM2, Qwen2.5-Coder-0.5B, Gemma 3 270M
    python -m bench.greedy_consistency --models smollm2-135m-instruct --kv-dtype f32
"""
from __future__ import annotations

import argparse

import kvlm  # noqa: F401  - before torch: it pins OpenMP threads
from kvlm import LLM, SamplingParams
from kvlm.loader.load import load_model

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma-3-270m")
PROMPTS = (
    "Name three rivers in Europe.",
    "What is a KV cache, in two sentences?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me a short poem about the sea.",
    "What are the main differences between TCP and UDP?",
    "List four prime numbers greater than 100.",
    "How do I make a cup of tea?",
    "Summarise the plot of Romeo and Juliet.",
    "Translate 'good morning, how are you?' into French.",
    "Why is the sky blue?",
    "Suggest three names for a pet turtle.",
)


def answers(llm: LLM, conversations: list, params: SamplingParams, together: bool) -> list[list[int]]:
    if together:
        return [out.token_ids for out in llm.chat(conversations, params, use_tqdm=False)]
    return [llm.chat([conversation], params, use_tqdm=False)[0].token_ids for conversation in conversations]


def measure(name: str, kv_dtype: str, max_tokens: int) -> dict[str, int]:
    model = load_model(name, progress=False)
    conversations = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    reference = answers(LLM(model, kv_dtype=kv_dtype, enable_prefix_caching=False), conversations, params, False)
    cached = LLM(model, kv_dtype=kv_dtype)
    runs = {"prefix caching, one at a time": answers(cached, conversations, params, False),
            "prefix caching, asked again": answers(cached, conversations, params, False),
            "prefix caching, all in one batch": answers(cached, conversations, params, True)}
    return {label: sum(a == b for a, b in zip(run, reference)) for label, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    print(f"| model | {' | '.join(['prefix caching, one at a time', 'asked again', 'all in one batch'])} |")
    print("|---|---|---|---|")
    for name in args.models:
        counts = measure(name, args.kv_dtype, args.max_tokens)
        cells = " | ".join(f"{n} of {len(PROMPTS)}" for n in counts.values())
        print(f"| {name} (KV {args.kv_dtype}) | {cells} |", flush=True)


if __name__ == "__main__":
    main()
