"""kvlm on the real SmolLM2 GGUF against transformers reading the same file (float32)."""
from __future__ import annotations

import pytest
import torch

from helpers.models import (
    full_sequence_logits, generation_logits, max_diff, prefill_then_decode_logits, reference_logits,
)
from kvlm.runtime.generate import GenerationSettings, generate

TOLERANCE = 1e-4

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 5, 8, 13,",
]
CHAT_MESSAGES = ["What is the boiling point of water?", "Write a haiku about the sea."]


def chat_ids(hf_tokenizer, message: str) -> list[int]:
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                            add_generation_prompt=True)
    return hf_tokenizer(text).input_ids


@pytest.mark.parametrize("prompt", RAW_PROMPTS)
def test_full_sequence_logits_match_transformers(smollm2, hf_smollm2, hf_smollm2_tokenizer, prompt):
    ids = hf_smollm2_tokenizer(prompt).input_ids
    assert max_diff(full_sequence_logits(smollm2, ids), reference_logits(hf_smollm2, ids)) <= TOLERANCE


@pytest.mark.parametrize("message", CHAT_MESSAGES)
def test_last_position_logits_match_transformers(smollm2, hf_smollm2, hf_smollm2_tokenizer, message):
    ids = chat_ids(hf_smollm2_tokenizer, message)
    last = prefill_then_decode_logits(smollm2, ids, len(ids))[0]
    assert max_diff(last, reference_logits(hf_smollm2, ids)[-1]) <= TOLERANCE


def _prompts(hf_tokenizer) -> list[list[int]]:
    raw = [hf_tokenizer(p).input_ids for p in RAW_PROMPTS[:3]]
    return raw + [chat_ids(hf_tokenizer, m) for m in CHAT_MESSAGES]


def test_greedy_continuations_equal_transformers_generate(smollm2, hf_smollm2, hf_smollm2_tokenizer):
    settings = GenerationSettings(max_tokens=32)
    for ids in _prompts(hf_smollm2_tokenizer):
        with torch.no_grad():
            expected = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        expected = expected[0, len(ids):].tolist()
        assert generate(smollm2, ids, settings).token_ids == expected


def test_cached_generation_equals_recomputation_and_transformers_at_every_step(smollm2, hf_smollm2,
                                                                               hf_smollm2_tokenizer):
    # generate's two paths: one token per batch over the cache, and the --no-cache baseline that clears the
    # memory and decodes the whole sequence each step. Step i samples from the logits of the sequence's
    # token len(ids) - 1 + i, row len(ids) - 1 + i of transformers' forward over the whole sequence.
    ids = hf_smollm2_tokenizer("The quick brown fox").input_ids
    runs = {use_cache: generation_logits(smollm2, ids, GenerationSettings(max_tokens=12, use_cache=use_cache))
            for use_cache in (True, False)}
    (cached, cached_logits), (scratch, scratch_logits) = runs[True], runs[False]
    assert cached.token_ids == scratch.token_ids
    assert max_diff(cached_logits, scratch_logits) <= TOLERANCE
    expected = reference_logits(hf_smollm2, ids + cached.token_ids[:-1])[len(ids) - 1 :]
    assert max_diff(cached_logits, expected) <= TOLERANCE


def test_decode_logits_match_transformers(smollm2, hf_smollm2, hf_smollm2_tokenizer):
    ids = hf_smollm2_tokenizer("Water boils at").input_ids
    logits = prefill_then_decode_logits(smollm2, ids, len(ids) - 1)
    assert max_diff(logits, reference_logits(hf_smollm2, ids)[-2:]) <= TOLERANCE


def test_changing_the_last_prompt_token_leaves_earlier_rows_bit_identical(smollm2, hf_smollm2_tokenizer):
    ids = hf_smollm2_tokenizer("Causality means the future cannot change the past").input_ids
    changed = ids[:-1] + [(ids[-1] + 1) % smollm2.config.vocab_size]
    before = full_sequence_logits(smollm2, ids)
    after = full_sequence_logits(smollm2, changed)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.equal(before[-1], after[-1])


def test_bfloat16_greedy_tracks_float32(smollm2_gguf_path, smollm2, hf_smollm2_tokenizer):
    from kvlm.loader.load import load_model

    bf16 = load_model(str(smollm2_gguf_path), "bfloat16")
    ids = hf_smollm2_tokenizer("The capital of France is").input_ids
    settings = GenerationSettings(max_tokens=8, ignore_eos=True)
    assert generate(bf16, ids, settings).token_ids[:3] == generate(smollm2, ids, settings).token_ids[:3]
