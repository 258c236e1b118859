"""Tensor parallelism on a real model (issue 15): Qwen2.5-Coder-0.5B (14 query heads, 2 KV heads, MLP 4864) on two
ranks, float32, against the same file on one: logits within 1e-4, and the same greedy tokens through
LLM.generate and through the OpenAI-compatible server."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
import uvicorn
from helpers.models import decode_ok, max_diff, on_two_ranks
from helpers.server import free_port

from kvlm import Batch, Context, load_model
from kvlm.engine.engine import Engine
from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams
from kvlm.server.app import create_app

TOLERANCE = 1e-4
PROMPTS = ["def fibonacci(n):", "# quicksort in Python\n", "def fibonacci(n):\n    if n < 2:"]


@pytest.fixture(scope="module")
def one(qwen_gguf_path):
    return load_model(str(qwen_gguf_path), "float32")


@pytest.fixture(scope="module")
def expected(one):
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    return LLM(one, max_num_seqs=4).generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module")
def two(qwen_gguf_path):
    yield from on_two_ranks(qwen_gguf_path)


def prompt_logits(model, ids: list[int]) -> torch.Tensor:
    ctx = Context(model, n_ctx=128, n_ubatch=16, n_seq_max=1)
    decode_ok(ctx, Batch(tokens=ids, logits=[True] * len(ids)))
    return torch.stack([ctx.get_logits_ith(i).clone() for i in range(len(ids))])


def test_each_rank_holds_half_the_heads(one, two):
    """The MLP's 4864 columns of down projections are 19 blocks of 256 (Q4_K/Q6_K): rank 0 takes 10 of them."""
    assert (two.config.n_head, two.config.n_head_kv, two.config.n_ff) == (7, 1, 2560)
    assert (one.config.n_head, one.config.n_head_kv, one.config.n_ff) == (14, 2, 4864)


def test_a_rank_holds_its_share_of_the_weights(one, two):
    """Rank 0 holds its share of every layer and of the LM head, and the whole (replicated) embedding."""
    embedding = one.decoder.token_embd.nbytes
    share = (two.decoder.nbytes - embedding) / (one.decoder.nbytes - embedding)
    assert 0.45 <= share <= 0.56, share


def test_prompt_logits_on_two_ranks_match_one(one, two):
    ids = one.tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    assert max_diff(prompt_logits(two, ids), prompt_logits(one, ids)) <= TOLERANCE


def test_llm_generate_on_two_ranks_equals_one(two, expected):
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    for ours, theirs in zip(LLM(two, max_num_seqs=4).generate(PROMPTS, params, use_tqdm=False), expected):
        assert ours.token_ids == theirs.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(ours.logprobs, theirs.logprobs)) <= TOLERANCE


def test_the_server_on_two_ranks_answers_as_one(two, expected):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(Engine(two, n_ctx=512, max_num_seqs=4), "qwen"),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        answers = {}

        def ask(prompt: str) -> None:
            body = {"model": "qwen", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0}
            answers[prompt] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()

        asking = [threading.Thread(target=ask, args=(prompt,)) for prompt in PROMPTS]
        for t in asking:
            t.start()
        for t in asking:
            t.join()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    for prompt, output in zip(PROMPTS, expected):
        choice = answers[prompt]["choices"][0]
        assert choice["text"] == output.text
        logprobs = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b.logprob) for a, b in zip(logprobs, output.logprobs, strict=True)) <= TOLERANCE
