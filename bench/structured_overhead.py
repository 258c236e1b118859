"""What an output constraint costs per generated token, at batch 1 and at 32 sequences, on kvlm's defaults.

    python -m bench.structured_overhead [--model NAME] [--batches 1 32] [--tokens 64] [--repeats 3]

The same B prompts run through `LLM.generate` free and then constrained by a JSON schema (an array of at least 64
words, so that no request ends before `--tokens`), greedy, EOS ignored; free and constrained alternate `--repeats`
times and the best of each is kept (the VM is noisy). The figure is decode time per token: each request's time
from its first token to its last over its tokens after the first, averaged over the requests. The constrained
run pays for the grammar's token masks (llguidance, one per token) and for applying them; its grammar is compiled
once before timing (compiling is off the step loop and cached).
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OpenMP's threads before they start

import argparse

from bench.common import add_model_option, machine_line, markdown_table, model_gguf
from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams

SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 64}
PROMPT = "List English words as a JSON array of strings, starting with the letter number {i} of the alphabet."


def per_token_ms(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    per_request = [o.decode_seconds / (len(o.token_ids) - 1) for o in outputs if len(o.token_ids) > 1]
    return sum(per_request) * 1e3 / len(per_request), sum(len(o.token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(str(model_gguf(args.model)), max_num_seqs=max(args.batches), n_ctx=4096)
    free = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True,
                                 structured_outputs={"json": SCHEMA})
    llm.engine.grammars.compile(constrained.structured_outputs)
    rows = []
    for batch in args.batches:
        prompts = [PROMPT.replace("{i}", str(i % 26 + 1)) for i in range(batch)]
        best = {"free": (float("inf"), 0), "json schema": (float("inf"), 0)}
        per_token_ms(llm, prompts, free)  # warm-up
        for _ in range(args.repeats):
            for name, params in (("free", free), ("json schema", constrained)):
                best[name] = min(best[name], per_token_ms(llm, prompts, params))
        masks = llm.engine.step_masks
        ratio = best["json schema"][0] / best["free"][0]
        rows.append([batch, f"{best['free'][0]:.2f}", f"{best['json schema'][0]:.2f}", best["json schema"][1],
                     f"{ratio:.3f}x", f"{(ratio - 1) * 100:+.1f}%"])
        print(f"batch {batch}: free {best['free'][0]:.2f} ms/token, constrained {best['json schema'][0]:.2f} "
              f"ms/token; masks so far {masks.n_masks} in {masks.mask_seconds:.2f} s "
              f"({masks.mask_seconds / max(masks.n_masks, 1) * 1e6:.0f} us each)", flush=True)
    print(f"\n{machine_line()}; {args.model}; best of {args.repeats}, {args.tokens} tokens per request\n")
    print(markdown_table(["batch", "free ms/token", "constrained ms/token", "constrained tokens", "ratio",
                          "overhead"], rows))


if __name__ == "__main__":
    main()
