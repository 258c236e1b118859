"""kvlm vs transformers `generate` on the same GGUF: batch 1, greedy, in one run.

Both are timed the same way from outside: decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)),
so prompt processing is excluded for both.

    python -m bench.vs_transformers [--model NAME_OR_GGUF] [--tokens 128]

kvlm runs float32, bfloat16 and bfloat16 with int4 weights; transformers runs at the same compute dtype.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import add_model_option, machine_line, markdown_table, median_seconds, model_gguf
from kvlm.runtime.generate import GenerationSettings, generate
from kvlm.loader.load import load_model

PROMPT = "Explain in a few paragraphs why the sky is blue and why sunsets are red."


def kvlm_runner(model, ids: list[int]):
    return lambda n: generate(model, ids, GenerationSettings(max_tokens=n, ignore_eos=True))


def transformers_runner(path, dtype: str, ids: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)).eval()
    prompt = torch.tensor([ids])

    def run(n: int):
        with torch.inference_mode():
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return run


def decode_rate(run, n_tokens: int, repeats: int) -> float:
    run(4)  # warm-up
    one = median_seconds(lambda: run(1), repeats)
    many = median_seconds(lambda: run(n_tokens), repeats)
    return (n_tokens - 1) / (many - one)


KVLM_SETUPS = [("auto", "auto"), ("float32", None)]  # the defaults a user gets, and the reference mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_option(parser)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = model_gguf(args.model)
    reference_rates: dict[str, float] = {}
    rows = []
    for dtype, quant in KVLM_SETUPS:
        model = load_model(str(path), dtype, quant=quant)
        dtype = model.decoder.settings.dtype  # what "auto" chose: transformers runs at the same compute dtype
        ids = model.tokenizer.encode(PROMPT)
        ours = decode_rate(kvlm_runner(model, ids), args.tokens, args.repeats)
        if dtype not in reference_rates:
            reference_rates[dtype] = decode_rate(transformers_runner(path, dtype, ids), args.tokens, args.repeats)
        theirs = reference_rates[dtype]
        weights = model.decoder.settings.quant or "dense"
        label = f"defaults ({dtype}, weights {weights})" if quant == "auto" else dtype
        rows.append([label, ours, theirs, ours / theirs])
        print(f"{label}: kvlm {ours:.1f} tok/s, transformers ({dtype}) {theirs:.1f} tok/s, {ours / theirs:.2f}x",
              flush=True)
    print(f"\n{machine_line()}, prompt {len(ids)} tokens, {args.tokens} new tokens, batch 1, greedy\n")
    header = ["kvlm setup", "kvlm decode tok/s", "transformers decode tok/s (same compute dtype)", "ratio"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
