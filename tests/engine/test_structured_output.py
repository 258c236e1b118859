"""Structured output in the engine: masks right by construction, constraints that hold in a shared batch
without touching the other rows, refusals before anything runs, grammars that never stall the step loop.

The model is the real SmolLM2 (float32); the masks are llguidance's over its real vocabulary.
"""
from __future__ import annotations

import json
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import torch

from kvlm.engine.llm import LLM
from kvlm.sampling.sampler import RequestSampler
from kvlm.sampling.params import SamplingParams
from kvlm.structured.compiler import MAX_JSON_WHITESPACE, GrammarCompiler, GrammarError
from kvlm.structured.params import StructuredOutputsParams
from kvlm.structured.request_grammar import RequestGrammar, TokenMask
from kvlm.structured.step_masks import StepMasks

# bounded, so that even a sampled output ends well within max_tokens on any CPU
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, n_ctx=1024, max_num_seqs=4)


@pytest.fixture(scope="module")
def compiler(llm):
    return llm.engine.grammars


def mask_of(compiler: GrammarCompiler, matcher) -> torch.Tensor:
    class Holder:  # StepMasks takes requests; one with this matcher
        request_id = "r"
        grammar = type("G", (), {"matcher": matcher})()
    return StepMasks(compiler).fill([Holder])["r"].tokens()


@pytest.mark.parametrize("params, text", [
    (StructuredOutputsParams(json=PERSON), '{"name": "Ada", "age": 36}'),
    (StructuredOutputsParams(regex=r"[a-c]{2}\d+"), "ab12"),
    (StructuredOutputsParams(choice=["left", "right"]), "right"),
])
def test_every_allowed_token_keeps_a_valid_prefix_and_every_other_breaks_it(compiler, smollm2, params, text):
    """At several points of a valid output, every token the step's mask allows is one the grammar accepts
    (llguidance's token-by-token validation, a different path from its mask computation), and every accepted
    token the mask refuses only spells part of the text the grammar forces next, which a longer token spells
    whole (the mask keeps forced text in the tokenizer's own canonical tokens)."""
    tokenizer, vocab = smollm2.tokenizer, compiler.vocab_size
    matcher = compiler.matcher(compiler.compile(params))
    for token_id in [None, *tokenizer.encode(text, add_special_tokens=False)]:
        if token_id is not None:
            assert matcher.consume_token(token_id)
        if matcher.is_stopped():
            break
        allowed = mask_of(compiler, matcher)
        checked = torch.tensor([matcher.validate_tokens([t]) == 1 for t in range(tokenizer.vocab_size)])
        allowed_ids = allowed[: tokenizer.vocab_size]
        assert not (allowed_ids & ~checked).any()
        forced = matcher.compute_ff_bytes()
        for refused in (checked & ~allowed_ids).nonzero().flatten().tolist():
            piece = tokenizer.token_bytes(refused)
            assert forced.startswith(piece) and len(piece) < len(forced), (refused, piece, forced)
        assert not allowed[tokenizer.vocab_size:].any()  # padded ids never
        assert 0 < int(allowed.sum()) < vocab


def test_json_whitespace_is_bounded(compiler, smollm2):
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(json=PERSON)))
    spaces = smollm2.tokenizer.encode(" ", add_special_tokens=False)
    assert matcher.consume_tokens(smollm2.tokenizer.encode("{", add_special_tokens=False))
    assert matcher.consume_tokens(spaces * MAX_JSON_WHITESPACE)
    assert matcher.validate_tokens(spaces) == 0  # one more is refused
    compact = compiler.matcher(compiler.compile(StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)))
    assert compact.validate_tokens(smollm2.tokenizer.encode("{ ", add_special_tokens=False)) == 1


def test_constrained_and_free_requests_share_a_batch(llm):
    prompt = "Here is a person as JSON:"
    free = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.generate([prompt], free, use_tqdm=False)[0]
    schema = SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": PERSON})
    sampled = SamplingParams(max_tokens=60, temperature=0.9, seed=3, structured_outputs={"json": PERSON})
    choice = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["yes", "no"]})
    outputs = llm.generate([prompt, prompt, prompt, "Is the sky green?"], [free, schema, sampled, choice],
                           use_tqdm=False)
    assert outputs[0].token_ids == alone.token_ids  # a free row is untouched by its constrained neighbours
    for output in outputs[1:3]:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), PERSON)
    assert outputs[3].text in ("yes", "no") and outputs[3].finish_reason == "stop"


def test_a_grammar_that_is_complete_ends_the_request(llm):
    output = llm.generate(["The colour of grass is"], SamplingParams(
        max_tokens=20, temperature=0, structured_outputs={"regex": " (green|blue)"}), use_tqdm=False)[0]
    assert output.text in (" green", " blue") and output.finish_reason == "stop"
    assert len(output.token_ids) <= 2


def test_a_constraint_that_cannot_compile_is_refused_before_anything_runs(llm):
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "object", "properties": {
        "a": {"type": "frobnicate"}}}})
    with pytest.raises(GrammarError, match="frobnicate"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


def test_a_compiling_grammar_does_not_hold_up_other_requests(llm, monkeypatch):
    pending: Future = Future()
    monkeypatch.setattr(llm.engine.grammars, "submit", lambda params: pending)
    engine = llm.engine
    slow = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, structured_outputs={"choice": ["x"]}))
    quick = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    while not engine.requests[quick].finished:
        engine.step()
    assert engine.requests[slow].n_computed == 0 and not engine.requests[slow].finished
    pending.set_result(engine.grammars.compile(StructuredOutputsParams(choice=["x"])))
    while engine.has_unfinished():
        engine.step()
    assert llm.tokenizer.decode(engine.release(slow).token_ids) == "x"
    engine.release(quick)


def test_a_failed_compilation_ends_only_its_request(llm, monkeypatch):
    failed: Future = Future()
    failed.set_exception(GrammarError("regex constraint cannot be compiled: unclosed group"))
    monkeypatch.setattr(llm.engine.grammars, "submit", lambda params: failed)
    engine = llm.engine
    bad = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, structured_outputs={"regex": "("}))
    while engine.has_unfinished():
        engine.step()
    output = engine.release(bad)
    assert output.finish_reason == "error" and "unclosed group" in output.error


def mask(allowed_ids: list[int], vocab_size: int) -> TokenMask:
    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    for token_id in allowed_ids:
        words[token_id // 32] |= np.uint32(1 << (token_id % 32))
    return TokenMask(torch.from_numpy(words.view(np.int32)), vocab_size)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_mask_comes_before_bias_and_logprobs_stay_raw(temperature):
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    params = SamplingParams(temperature=temperature, logit_bias={1: 100.0, 3: 100.0}, logprobs=1, seed=0)
    sampled = RequestSampler(params, []).sample(logits, mask([0, 2], 4))
    assert sampled.token_id in (0, 2)  # bias cannot bring back a masked token
    if temperature == 0:
        assert sampled.token_id == 2
    assert sampled.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[sampled.token_id]))
    assert sampled.top_logprobs[0][0] == 1  # the raw distribution's best


def test_greedy_under_a_mask_whose_free_argmax_is_allowed_takes_it():
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    assert RequestSampler(SamplingParams(temperature=0), []).sample(logits, mask([1, 2], 4)).token_id == 1
    assert RequestSampler(SamplingParams(temperature=0, repetition_penalty=2.0), [1]).sample(
        logits, mask([0, 3], 4)).token_id == 3


def test_a_token_mask_reads_the_bitmask_bit_by_bit():
    row = torch.tensor([0b1010, -2**31], dtype=torch.int32)  # tokens 1 and 3; and bit 31 of the second word
    allowed = TokenMask(row, 64)
    assert allowed.tokens().nonzero().flatten().tolist() == [1, 3, 63]
    assert [allowed.allows(t) for t in (0, 1, 3, 62, 63)] == [False, True, True, False, True]


def test_a_reasoning_output_is_free_until_its_end(compiler, smollm2):
    done: Future = Future()
    done.set_result(compiler.compile(StructuredOutputsParams(choice=["ok"])))
    ended = lambda text: (text.index("</think>") + 8) if "</think>" in text else None  # noqa: E731
    grammar = RequestGrammar(done, compiler, ended)
    assert not grammar.active("<think>hmm", [1, 2])
    assert grammar.active("<think>hmm</think>", [1, 2, 3])
    assert grammar.matcher.validate_tokens(smollm2.tokenizer.encode("ok", add_special_tokens=False)) >= 1
    no_reasoning = RequestGrammar(done, compiler, lambda text: 0)
    first = smollm2.tokenizer.encode("o", add_special_tokens=False)
    assert no_reasoning.active("o", first)  # the free first token is followed
    assert no_reasoning.matcher.validate_tokens(smollm2.tokenizer.encode("k", add_special_tokens=False)) == 1


def test_llm_chat_forces_a_json_call_on_a_model_without_a_tool_format(llm):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    output = llm.chat(messages, SamplingParams(max_tokens=60, temperature=0), use_tqdm=False, tools=[weather],
                      tool_choice="required", parallel_tool_calls=False)[0]
    assert output.finish_reason == "tool_calls", output.text
    [call] = output.message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), weather["function"]["parameters"])
    with pytest.raises(ValueError, match="no tool-call format"):
        llm.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False, tools=[weather])
    assert not llm.engine.requests
