"""`kvlm bench`: offline throughput as a user gets it (after vLLM's `vllm bench throughput`): random prompts of
one length, all submitted at once, each generating a fixed number of tokens (greedy, end-of-sequence ignored)."""
from __future__ import annotations

import time

import torch

from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams

WARMUP_TOKENS = 4


def random_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """The same token ids for a given seed, so that other engines can be given the same prompts."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, input_len), generator=generator).tolist()


def run_benchmark(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """Prefill speed (every prompt token over the time until the last request's first token), decode speed (the
    other generated tokens over the rest) and the totals. A short untimed request warms the engine up first."""
    llm.generate([prompts[0][:WARMUP_TOKENS]], SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    prefill_s = max(output.time_to_first_token for output in outputs)
    n_prompt = sum(len(prompt) for prompt in prompts)
    n_generated = sum(len(output.token_ids) for output in outputs)
    return {
        "num_prompts": len(prompts), "input_len": len(prompts[0]), "output_len": output_len,
        "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
        "prefill_tokens_per_s": n_prompt / prefill_s,
        "decode_tokens_per_s": (n_generated - len(prompts)) / max(elapsed - prefill_s, 1e-9),
        "total_tokens_per_s": (n_prompt + n_generated) / elapsed,
        "token_ids": [output.token_ids for output in outputs],
        **({} if llm.engine.speculator is None else {"speculative": llm.engine.speculator.stats.to_json()}),
    }
