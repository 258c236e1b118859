"""kvlm.runtime.generate on the real SmolLM2: the single-sequence loop through Context, its limits and its errors.

Its logits against transformers, cached and recomputed, are checked in test_smollm2_vs_transformers.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import kvlm.cli.commands
from kvlm import DecodeStatus
from kvlm.core.errors import CacheError
from kvlm.runtime.generate import GenerationError, GenerationSettings, generate

PROMPT = "The capital of France is"


@pytest.fixture
def short_context(smollm2):
    """SmolLM2 as if trained on 12 positions: the same weights, a context that fills in a few steps."""
    return replace(smollm2, config=replace(smollm2.config, n_ctx_train=12))


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_sequence_that_fills_the_model_context_ends_with_length(short_context, use_cache):
    prompt = short_context.tokenizer.encode("one two three four five six seven eight nine ten")[:10]
    settings = GenerationSettings(max_tokens=100, ignore_eos=True, use_cache=use_cache)
    result = generate(short_context, prompt, settings)
    # Positions 10 and 11 take the first two generated tokens; the third is sampled from position 11.
    assert len(result.token_ids) == 12 - len(prompt) + 1
    assert result.finish_reason == "length"
    assert result.prefill_seconds > 0 and result.timings["decode_tokens_per_s"] > 0


def test_a_prompt_as_long_as_the_model_context_is_refused(short_context):
    with pytest.raises(CacheError, match="the prompt has 12 tokens; the model's context is 12"):
        generate(short_context, list(range(1, 13)), GenerationSettings(max_tokens=1))


def test_an_empty_prompt_is_refused(smollm2):
    with pytest.raises(ValueError, match="empty"):
        generate(smollm2, [], GenerationSettings())


def test_a_refused_batch_names_the_status_and_the_reason(smollm2):
    with pytest.raises(GenerationError, match=r"INVALID_BATCH: tokens\[1\] = 49152 is outside the vocabulary") as error:
        generate(smollm2, [1, 49152], GenerationSettings(max_tokens=2))
    assert error.value.status == DecodeStatus.INVALID_BATCH


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_failed_step_names_the_status_and_the_reason(smollm2, fail_forward_at, use_cache):
    fail_forward_at(smollm2.decoder, 3)  # the prefill and one step run; the second step fails
    settings = GenerationSettings(max_tokens=8, ignore_eos=True, use_cache=use_cache)
    with pytest.raises(GenerationError, match="COMPUTE_FAILED: compute failed in micro-batch 1 of 1: "
                                              "RuntimeError: injected failure") as error:
        generate(smollm2, smollm2.tokenizer.encode(PROMPT), settings)
    assert error.value.status == DecodeStatus.COMPUTE_FAILED


def test_no_cache_command_prints_the_cached_tokens(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(kvlm.cli.commands, "load_model", lambda *args, **kwargs: smollm2)
    outputs = {}
    for flag in ([], ["--no-cache"]):
        assert kvlm.cli.commands.main(["generate", "--prompt", PROMPT, "--max-tokens", "6", "--json", *flag]) == 0
        outputs[bool(flag)] = json.loads(capsys.readouterr().out)
    assert outputs[True]["token_ids"] == outputs[False]["token_ids"]
    assert outputs[True]["text"] == outputs[False]["text"]
    assert outputs[True]["prompt_token_ids"] == smollm2.tokenizer.encode(PROMPT)
    assert set(outputs[True]["timings"]) == set(outputs[False]["timings"])
    assert outputs[True]["timings"]["prefill_tokens_per_s"] > 0
