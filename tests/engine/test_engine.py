"""The engine on the real SmolLM2: continuous batching, preemption, prefix reuse, streaming."""
from __future__ import annotations

import pytest
import torch

from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams
from kvlm.structured.params import StructuredOutputsParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TOPICS = ["rivers", "mountains", "the moon", "bread", "music", "trains", "bees", "winter",
          "chess", "volcanoes", "the sea", "gardens", "clocks", "owls", "paper", "bridges"]


@pytest.fixture(scope="module")
def prompts():
    return [f"Here is a short fact about {topic}:" for topic in TOPICS]


def make_llm(model, **kwargs) -> LLM:
    return LLM(model, **{"n_ctx": 2048, "max_num_seqs": 16, **kwargs})


def alone(model, prompt, params=GREEDY, **kwargs):
    return make_llm(model, **kwargs).generate([prompt], params, use_tqdm=False)[0]


def test_concurrent_greedy_requests_equal_each_alone_and_transformers(smollm2, hf_smollm2, prompts):
    together = make_llm(smollm2).generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, together):
        assert output.token_ids == alone(smollm2, prompt).token_ids
        ids = smollm2.tokenizer.encode(prompt)
        with torch.no_grad():
            reference = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert output.token_ids == reference[0, len(ids):].tolist()
        assert output.finish_reason in ("stop", "length")


def test_seeded_sampling_is_the_same_alone_and_among_others(smollm2, prompts):
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    mixed = [SamplingParams(max_tokens=10, temperature=1.0, seed=s) for s in range(len(prompts) - 1)]
    outputs = make_llm(smollm2).generate(prompts, [seeded] + mixed, use_tqdm=False)
    assert outputs[0].token_ids == alone(smollm2, prompts[0], seeded).token_ids


def test_preemption_under_a_tiny_context_still_gives_the_right_tokens(smollm2, prompts):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = make_llm(smollm2, n_ctx=96, max_num_seqs=6, enable_prefix_caching=False)
    outputs = llm.generate(prompts[:6], params, use_tqdm=False)
    assert llm.engine.scheduler.n_preemptions > 0
    for prompt, output in zip(prompts[:6], outputs):
        assert len(output.token_ids) == 24
        assert output.token_ids == alone(smollm2, prompt, params).token_ids


def _long_prefix(model) -> str:
    sentence = "The committee reviewed every chapter of the annual report with great care. "
    return sentence * 40


def test_second_request_with_a_cached_prefix_prefills_only_its_suffix(smollm2):
    llm = make_llm(smollm2)
    prefix = _long_prefix(smollm2)
    first = llm.generate([prefix + "First question: what was reviewed?"], GREEDY, use_tqdm=False)[0]
    computed_before = llm.engine.n_prefill_tokens
    second_prompt = prefix + "Second question: who reviewed it?"
    second = llm.generate([second_prompt], GREEDY, use_tqdm=False)[0]
    n_prompt = len(second.prompt_token_ids)
    assert first.n_cached_tokens == 0
    assert second.n_cached_tokens >= len(smollm2.tokenizer.encode(prefix)) - 16
    assert llm.engine.n_prefill_tokens - computed_before == n_prompt - second.n_cached_tokens
    assert second.token_ids == alone(smollm2, second_prompt, enable_prefix_caching=False).token_ids


def test_a_fully_cached_prompt_still_computes_its_last_token(smollm2):
    llm = make_llm(smollm2)
    prompt = _long_prefix(smollm2)[:400]
    first, second = (llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert second.n_cached_tokens > 0
    assert second.n_cached_tokens < len(second.prompt_token_ids)
    assert second.token_ids == first.token_ids


def test_a_preempted_request_that_hits_the_cache_comes_back_right(smollm2):
    prefix = _long_prefix(smollm2)[:300]
    prompts = [prefix + f" Item {i}:" for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    n_prompt = len(smollm2.tokenizer.encode(prompts[0]))
    llm = make_llm(smollm2, n_ctx=n_prompt + 2 * 16 + 40, max_num_seqs=4, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.n_preemptions > 0
    assert llm.engine.prefix_cache.hit_tokens > 0
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == alone(smollm2, prompt, params, enable_prefix_caching=False).token_ids


def test_a_prompt_that_can_never_fit_fails_alone(smollm2, prompts):
    llm = make_llm(smollm2, n_ctx=64)
    too_long = "word " * 100
    outputs = llm.generate([prompts[0], too_long, prompts[1]], GREEDY, use_tqdm=False)
    assert outputs[1].finish_reason == "error"
    assert "exceeds n_ctx = 64" in outputs[1].error
    assert outputs[0].token_ids == alone(smollm2, prompts[0]).token_ids
    assert outputs[2].finish_reason in ("stop", "length") and outputs[2].token_ids


def test_stop_strings_end_the_text_before_them(smollm2, prompts):
    free = alone(smollm2, prompts[0], SamplingParams(max_tokens=20, temperature=0.0))
    stop = free.text[5:9]
    cut = alone(smollm2, prompts[0], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]


def test_stream_pieces_add_up_to_the_text(smollm2):
    llm = make_llm(smollm2)
    chunks = list(llm.stream("Emoji and accents: 🌍 café ", SamplingParams(max_tokens=24, temperature=0.0)))
    assert chunks[-1].finished and chunks[-1].output is not None
    assert "".join(c.text for c in chunks) == chunks[-1].output.text
    assert all("\ufffd" not in c.text for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == chunks[-1].output.token_ids


def test_chat_uses_the_template_and_progress_bar_shows(smollm2, capsys):
    llm = make_llm(smollm2)
    out = llm.chat([{"role": "user", "content": "Say hello."}], GREEDY)[0]
    expected_prompt = smollm2.tokenizer.encode(
        smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}]))
    assert out.prompt_token_ids == expected_prompt
    assert "requests" in capsys.readouterr().err


def test_logit_bias_outside_the_vocabulary_fails_only_its_request(smollm2, prompts):
    llm = make_llm(smollm2)
    bad = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={10**8: 5.0})
    good, broken = llm.generate([prompts[0], prompts[1]], [GREEDY, bad], use_tqdm=False)
    assert broken.finish_reason == "error" and str(10**8) in broken.error
    assert good.token_ids == alone(smollm2, prompts[0]).token_ids


def test_sampling_a_steps_rows_at_once_gives_each_request_its_own_tokens(smollm2, prompts):
    """The GPU's way (the step's rows sampled together where the logits are, kvlm.sampling.batch), forced on the
    CPU, against each request's own sampler taking its row: the same tokens and logprobs for greedy, seeded random
    (top-k, top-p, min-p, penalties) and constrained requests, beside requests verifying guessed tokens."""
    params = [GREEDY,
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(max_tokens=12, temperature=1.0, top_k=30, min_p=0.05, seed=4, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.4, seed=5),
              SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5),
              SamplingParams(max_tokens=12, temperature=0.9, seed=6,
                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{2,6}){2}"))]
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    results = {}
    for batched in (False, True):
        llm = make_llm(smollm2, max_num_seqs=6, speculative_config=speculative)
        llm.engine.batched_sampling = batched
        results[batched] = llm.generate(prompts[:6], params, use_tqdm=False)
    for one_by_one, at_once in zip(results[False], results[True]):
        assert at_once.token_ids == one_by_one.token_ids
        if one_by_one.logprobs is not None:
            assert [t.logprob for t in at_once.logprobs] == pytest.approx([t.logprob for t in one_by_one.logprobs],
                                                                         abs=1e-5)
