"""Gemma 3 against transformers on random-weight models it builds: a window of 8 positions, crossed many times.

The model has MQA (4 query heads, 1 KV head), QK-norm, sandwich norms, GeGLU, scaled embeddings, a query scale
from query_pre_attn_scalar, linear RoPE scaling on its full layer and another base on its sliding ones (layer 5
of 7 is full), read from a transformers 5 folder (norms stored as w - 1) and from a GGUF written as llama.cpp's
converter writes it (norms + 1, the window in gemma3.attention.sliding_window, no query scale: llama.cpp's rule).
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import Gemma3ForCausalLM

from helpers.gemma3_factory import FULL_ROPE, LOCAL_ROPE, WINDOW, gguf_of, random_gemma3
from helpers.gguf_factory import save_hf_folder
from helpers.models import (
    decode_ok, full_sequence_logits, max_diff, one_batch, prefill_then_decode_logits, reference_logits, token_ids,
)
from kvlm import LLM, Batch, Context, SamplingParams, load_model
from kvlm.core.family import SLIDING
from kvlm.core.config import ModelConfig

TOLERANCE = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["hf", "hf-old", "gguf"])
def source(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(source) -> Gemma3ForCausalLM:
    """A folder keeps any query_pre_attn_scalar (24 here); a GGUF has none, and llama.cpp's rule gives head_dim."""
    return random_gemma3(32 if source == "gguf" else 24)


@pytest.fixture(scope="module")
def ours(source, reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gemma3-{source}")
    if source == "gguf":
        return load_model(str(gguf_of(reference, folder)), "float32")
    save_hf_folder(reference, folder)
    if source == "hf-old":
        old_spelling(folder / "config.json")
    return load_model(str(folder), "float32")


def old_spelling(path) -> None:
    """config.json as transformers 4.x wrote Gemma 3's: rope_theta and rope_scaling for the full layers,
    rope_local_base_freq for the sliding ones."""
    config = json.loads(path.read_text())
    del config["rope_parameters"]
    config.update(rope_theta=FULL_ROPE["rope_theta"], rope_local_base_freq=LOCAL_ROPE["rope_theta"],
                  rope_scaling={"rope_type": "linear", "factor": FULL_ROPE["factor"]})
    path.write_text(json.dumps(config))


def test_config_reads_the_window_and_layer_kinds(ours):
    config = ours.config
    assert config.sliding_window == WINDOW
    assert config.layer_kinds == (SLIDING,) * 5 + ("attention", SLIDING)
    assert config.rope.kind == "linear" and config.rope_local.theta == LOCAL_ROPE["rope_theta"]


def test_logits_of_a_prompt_far_longer_than_the_window(ours, reference):
    ids = token_ids(1000, 60, seed=1)
    assert max_diff(full_sequence_logits(ours, ids), reference_logits(reference, ids)) <= TOLERANCE


def test_prefill_then_decode_across_the_window(ours, reference):
    ids = token_ids(1000, 40, seed=2)
    expected = reference_logits(reference, ids)[11:]
    assert max_diff(prefill_then_decode_logits(ours, ids, 12), expected) <= TOLERANCE


def test_several_sequences_in_one_batch_and_micro_batches_that_straddle_the_window(ours, reference):
    prompts = [token_ids(1000, n, seed=n) for n in (30, 5, 17)]
    ctx = Context(ours, n_ctx=128, n_ubatch=7, n_seq_max=3)  # micro-batches of 7 cut across windows of 8
    decode_ok(ctx, one_batch(prompts))
    for i, ids in enumerate(prompts):
        assert max_diff(ctx.get_logits_ith(i), reference_logits(reference, ids)[-1]) <= TOLERANCE


def greedy_pair(ours, reference, prompt: list[int], n_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' greedy continuation of `prompt` and kvlm's, one token per decode, as long as transformers'."""
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, do_sample=False)
    expected = expected[0, len(prompt):].tolist()
    ctx = Context(ours, n_ctx=len(prompt) + n_tokens, n_seq_max=1)
    decode_ok(ctx, Batch.for_sequence(prompt))
    generated = []
    for _ in expected:
        generated.append(int(ctx.get_logits_ith(-1).argmax()))
        decode_ok(ctx, Batch.for_sequence(generated[-1:]))
    return generated, expected


def test_greedy_continuation_equals_transformers(ours, reference):
    generated, expected = greedy_pair(ours, reference, token_ids(1000, 10, seed=3), 24)
    assert generated == expected


def test_shifted_positions_rotate_each_kind_with_its_own_base(ours, reference):
    """seq_add moves cached keys by a delta: full and sliding layers re-rotate with their own RoPE."""
    ids = token_ids(1000, 20, seed=4)
    ctx = Context(ours, n_ctx=64, n_seq_max=1)
    decode_ok(ctx, Batch.for_sequence(ids[:12], start_pos=0))
    ctx.memory.seq_add(0, 0, 12, 5)  # the 12 cached tokens now sit at positions 5..16
    decode_ok(ctx, Batch.for_sequence(ids[12:], start_pos=17))
    expected = _logits_at_positions(reference, ids, list(range(5, 17)) + list(range(17, 25)))
    assert max_diff(ctx.get_logits_ith(-1), expected[-1]) <= TOLERANCE


def _logits_at_positions(model, ids, positions):
    with torch.no_grad():
        return model(torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0].float()


def test_sliding_layers_without_a_window_are_refused():
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig(architecture="gemma3", name="x", n_layer=2, n_embd=8, n_ff=8, n_head=1, n_head_kv=1, head_dim=8,
                    vocab_size=10, n_ctx_train=16, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    layer_kinds=(SLIDING, "attention"))


# --- the real Gemma 3 270M (Q4_K_M, window 512), against transformers' reading of the same file ---

@pytest.fixture(scope="module")
def real_gemma(gemma_gguf_path):
    return load_model(str(gemma_gguf_path), "float32")


@pytest.fixture(scope="module")
def long_prompt(real_gemma, hf_gemma) -> tuple[list[int], torch.Tensor]:
    """A prompt of more than two windows and transformers' logits of each of its tokens."""
    ids = real_gemma.tokenizer.encode("The river valley was settled long before the first mills were built. " * 80)
    assert len(ids) > 2 * real_gemma.config.sliding_window
    return ids, reference_logits(hf_gemma, ids)


def test_real_gemma_logits_over_a_prompt_longer_than_its_window(real_gemma, long_prompt):
    ids, expected = long_prompt
    assert max_diff(full_sequence_logits(real_gemma, ids), expected) <= TOLERANCE


def test_real_gemma_through_the_iswa_pools_as_llama_cpp_sizes_them(real_gemma, hf_gemma, long_prompt):
    """n_ctx 2048 and micro-batches of 512: the sliding pool has 512 + 512 cells, so the prompt's third micro-batch
    already reuses cells freed from the windows. The chunked prompt's logits are transformers'; 16 greedy tokens
    after it are transformers' greedy continuation, and each step's logits those of every cell kept (swa_full).
    (Against transformers, decode steps this deep drift to ~1.4e-4 with every cell kept too: float32 noise.)"""
    ids, expected = long_prompt
    runs = [Context(real_gemma, n_ctx=2048, n_ubatch=512, n_seq_max=1, swa_full=swa_full) for swa_full in (False, True)]
    sliding = runs[0].memory.sliding
    assert sliding.n_cells == 1024
    for ctx in runs:
        decode_ok(ctx, Batch.for_sequence(ids))
    assert max_diff(runs[0].get_logits_ith(-1), expected[-1]) <= TOLERANCE
    generated = []
    for _ in range(16):
        logits = [ctx.get_logits_ith(-1) for ctx in runs]
        assert max_diff(logits[0], logits[1]) <= TOLERANCE
        generated.append(int(logits[0].argmax()))
        for ctx in runs:
            decode_ok(ctx, Batch.for_sequence(generated[-1:]))
    assert (runs[0].memory.full.n_used, sliding.n_used) == (len(ids) + 16, 512)
    with torch.no_grad():
        reference = hf_gemma.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert generated == reference[0, len(ids):].tolist()


def test_real_gemma_greedy_continuation_equals_transformers(real_gemma, hf_gemma):
    prompt = real_gemma.tokenizer.encode("The three largest cities of Japan are")
    generated, expected = greedy_pair(real_gemma, hf_gemma, prompt, 20)
    assert generated == expected and len(expected) > 5


def test_engine_prefix_reuse_gives_the_outputs_of_a_run_without_it(ours, reference):
    """Requests sharing a 40-token prefix (five windows) through LLM.generate: the later ones borrow its cells,
    and every output equals its own run with prefix caching off, and transformers' greedy continuation."""
    prefix = token_ids(1000, 40, seed=5)
    prompts = [prefix + token_ids(1000, 3 + i, seed=10 + i) for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reused = LLM(ours, n_ctx=256, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    assert sum(output.n_cached_tokens for output in reused) >= 2 * 32  # later requests borrowed the prefix
    for prompt, output in zip(prompts, reused):
        plain = LLM(ours, n_ctx=256, enable_prefix_caching=False).generate([prompt], params, use_tqdm=False)[0]
        assert output.token_ids == plain.token_ids
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                          min_new_tokens=10)[0, len(prompt):].tolist()
        assert output.token_ids == expected
