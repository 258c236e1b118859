"""Every family kvlm supports, with every RoPE scaling it reads, against transformers.

Tiny random models made by transformers (family_factory) are read from three spellings: a transformers 5
folder, a folder with the older `rope_theta` + `rope_scaling` config, and a GGUF written as llama.cpp's
converter writes it. Test prompts run well past the models' original_max_position_embeddings (64), so a
scaling read wrongly, or applied differently by the forward pass and the cache's K-shift, shows.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from helpers.family_factory import ORIGINAL_POSITIONS, SOURCES, SPECS, head_dim_of, random_model, save_model
from helpers.models import (
    ModelZoo, assert_greedy_generate_equals_transformers, decode_ok, full_sequence_logits, max_diff, memory_state,
    one_batch, prefill_then_decode_logits, reference_logits, token_ids,
)
from kvlm import Batch, Context, DecodeStatus, load_model
from kvlm.core.rope import Rope

TOLERANCE = 1e-4
N_GREEDY = 16
# (prompt length, of which prefilled): short, and long enough that decode steps run past position 64.
LENGTHS = {"short": (10, 6), "long": (120, 100)}
CONTEXT_LENGTHS = (70, 23, 95)  # three sequences in one batch; the longest crosses ORIGINAL_POSITIONS
CONTEXT_STEPS = 3
KV_TOLERANCES = {"f16": 0.05, "bf16": 0.3, "q8_0": 0.6}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> ModelZoo:
    return ModelZoo(tmp_path_factory, lambda name: random_model(SPECS[name]),
                    lambda model, name, source, folder: save_model(model, SPECS[name], source, folder))


@pytest.fixture(scope="module", params=list(SPECS))
def name(request) -> str:
    return request.param


@pytest.fixture(params=SOURCES)
def source(request) -> str:
    return request.param


# --- the files themselves, and the config kvlm reads from them ---

def test_old_spelling_means_the_same_to_transformers(zoo, name, reference):
    """A check of the factory: transformers reads the rewritten config.json as the model's own RoPE."""
    config = transformers.AutoConfig.from_pretrained(zoo.path(name, "hf-old"))
    read = {k: v for k, v in config.rope_parameters.items() if k != "type"}
    assert read == reference.config.rope_parameters


def test_config_is_the_same_from_every_source(zoo, name, reference):
    configs = {source: zoo.ours(name, source).config for source in SOURCES}
    hf, spec = reference.config, SPECS[name]
    for source, c in configs.items():
        assert (c.architecture, c.n_layer, c.n_embd, c.n_ff) == (
            spec.arch, hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size), source
        assert (c.n_head, c.n_head_kv, c.head_dim, c.vocab_size) == (
            hf.num_attention_heads, hf.num_key_value_heads, head_dim_of(hf), hf.vocab_size), source
        assert (c.n_ctx_train, c.tie_word_embeddings) == (hf.max_position_embeddings, hf.tie_word_embeddings), source
        assert c.rope.theta == hf.rope_parameters["rope_theta"], source
        # GGUF stores the epsilon as float32, as llama.cpp does.
        assert c.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6), source
    folder, gguf = configs["hf-new"], configs["gguf"]
    assert folder.rope.kind == hf.rope_parameters["rope_type"]
    if folder.rope.kind == "longrope":  # its factor derived: max_position_embeddings / the original
        assert folder.rope.factor == hf.max_position_embeddings / hf.rope_parameters["original_max_position_embeddings"]
        # GGUF holds the factors and the attention factor as float32: the same rotations are all that can agree
        for n_ctx in (ORIGINAL_POSITIONS, ORIGINAL_POSITIONS + 1):
            ours, theirs = (Rope(c.rope.for_context(n_ctx), c.rotary_dims) for c in (gguf, folder))
            assert torch.allclose(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
            assert ours.attention_factor == pytest.approx(theirs.attention_factor, rel=1e-6)
        gguf = replace(gguf, rope=folder.rope)
    else:
        assert folder.rope.factor == hf.rope_parameters.get("factor", 1.0)
    assert replace(configs["hf-old"], name="") == replace(folder, name="")
    if SPECS[name].rope.get("rope_type") == "llama3":
        # llama.cpp keeps Llama 3 scaling as per-frequency divisors (rope_freqs.weight), not as parameters:
        # the same frequencies are all that can agree.
        assert gguf.rope.theta == folder.rope.theta
        ours, theirs = (Rope(c.rope, c.head_dim) for c in (gguf, folder))
        assert torch.allclose(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0)
        assert ours.attention_factor == theirs.attention_factor
        gguf = replace(gguf, rope=folder.rope)
    assert replace(gguf, name="", rms_norm_eps=0.0) == replace(folder, name="", rms_norm_eps=0.0)


def test_rope_tables_match_transformers(ours, reference):
    """cos/sin (attention factor included) at every position, against the transformers model's own."""
    positions = torch.arange(reference.config.max_position_embeddings)
    x = torch.zeros(1, len(positions), 1)
    with torch.no_grad():
        cos, sin = reference.model.rotary_emb(x, positions[None])
    rope = ours.decoder.fit_context(len(positions))[0]  # as a context of every position rotates (LongRoPE's long)
    our_cos, our_sin = rope.cos_sin(positions, torch.float32)
    assert max_diff(our_cos[:, 0], cos[0]) <= 5e-5
    assert max_diff(our_sin[:, 0], sin[0]) <= 5e-5


# --- the decoder against transformers ---

@pytest.mark.parametrize("length", list(LENGTHS))
def test_logits_match_transformers(ours, reference, length):
    n, n_prompt = LENGTHS[length]
    ids = token_ids(ours.config.vocab_size, n, seed=n)
    expected = reference_logits(reference, ids)
    assert max_diff(full_sequence_logits(ours, ids), expected) <= TOLERANCE
    assert max_diff(prefill_then_decode_logits(ours, ids, n_prompt), expected[n_prompt - 1 :]) <= TOLERANCE


def test_greedy_llm_generate_equals_transformers_generate(zoo, name, source, reference):
    """A short request in a context within the original length, a long one in a longer context: transformers' LongRoPE
    rotates each with the factors kvlm chooses for its context."""
    for n, n_ctx in ((8, ORIGINAL_POSITIONS), (100, 256)):
        prompt = token_ids(reference.config.vocab_size, n, seed=n + 1)
        assert_greedy_generate_equals_transformers(zoo.path(name, source), reference, [prompt], N_GREEDY, n_ctx=n_ctx)


def test_phi3_long_factors_past_the_original_context(zoo):
    """A prompt past the original context is rotated with the long factors in a context that long (as transformers
    rotates it); with the short ones there the logits move away from transformers'."""
    ids = token_ids(1000, 120, seed=4)
    expected = reference_logits(zoo.reference("phi3-longrope"), ids)
    model = load_model(str(zoo.path("phi3-longrope", "gguf")), "float32", progress=False)
    assert max_diff(full_sequence_logits(model, ids), expected) <= TOLERANCE
    rope = model.config.rope
    model.decoder.config = replace(model.config, rope=replace(rope, long_factor=rope.short_factor))
    assert max_diff(full_sequence_logits(model, ids), expected) > 100 * TOLERANCE


def test_smollm3_attends_without_rope_in_every_fourth_layer(zoo):
    """The layers config.json's no_rope_layers (or llama.cpp's rule) leave unrotated; with RoPE there too the logits
    move away from transformers'."""
    ids = token_ids(1000, 40, seed=3)
    expected = reference_logits(zoo.reference("smollm3"), ids)
    for source in SOURCES:
        model = load_model(str(zoo.path("smollm3", source)), "float32", progress=False)
        assert model.config.unrotated_layers == (3,), source
        assert max_diff(full_sequence_logits(model, ids), expected) <= TOLERANCE
        model.decoder.config = replace(model.config, unrotated_layers=())  # the next context's RoPE
        assert max_diff(full_sequence_logits(model, ids), expected) > 100 * TOLERANCE, source


# --- Context: several sequences, cache dtypes, shift, rollback ---

def new_context(model, **kwargs) -> Context:
    return Context(model, **{"n_ctx": 256, "n_batch": 256, "n_ubatch": 64, "n_seq_max": 8, **kwargs})


def context_prompts(model) -> list[list[int]]:
    return [token_ids(model.config.vocab_size, n, seed=100 + n) for n in CONTEXT_LENGTHS]


def run_alone(model, ids: list[int], kv_dtype: str = "f32") -> tuple[list[int], list[torch.Tensor]]:
    """Greedy steps of one sequence in a context of its own: the tokens fed, and the logits of each step."""
    ctx = new_context(model, kv_dtype=kv_dtype)
    decode_ok(ctx, Batch.for_sequence(ids))
    logits, tokens = [ctx.get_logits_ith(-1).clone()], []
    for _ in range(CONTEXT_STEPS):
        tokens.append(int(logits[-1].argmax()))
        decode_ok(ctx, Batch.for_sequence([tokens[-1]]))
        logits.append(ctx.get_logits_ith(-1).clone())
    return tokens, logits


def run_together(model, prompts, fed: list[list[int]] | None, kv_dtype: str = "f32"):
    """All prompts in one batch (cut into micro-batches), then one decode token per sequence per step.

    The tokens fed are `fed[s]` if given (so every cache dtype sees the same input), else each sequence's
    own argmax. Returns the tokens fed and logits[s][step].
    """
    ctx = new_context(model, kv_dtype=kv_dtype)
    decode_ok(ctx, one_batch(prompts))
    logits = [[ctx.get_logits_ith(s).clone()] for s in range(len(prompts))]
    fed_now = [[] for _ in prompts]
    for step in range(CONTEXT_STEPS):
        step_tokens = [fed[s][step] if fed else int(logits[s][-1].argmax()) for s in range(len(prompts))]
        for s, t in enumerate(step_tokens):
            fed_now[s].append(t)
        decode_ok(ctx, Batch(tokens=step_tokens, seq_ids=list(range(len(prompts))), logits=[True] * len(prompts)))
        for s in range(len(prompts)):
            logits[s].append(ctx.get_logits_ith(s).clone())
    return fed_now, logits


@pytest.fixture
def gguf_model(zoo, name):
    return zoo.ours(name, "gguf")


def test_sequences_in_one_batch_equal_each_alone(gguf_model):
    prompts = context_prompts(gguf_model)
    fed, together = run_together(gguf_model, prompts, None)
    for s, ids in enumerate(prompts):
        alone_tokens, alone_logits = run_alone(gguf_model, ids)
        assert fed[s] == alone_tokens, s
        for step, expected in enumerate(alone_logits):
            assert max_diff(together[s][step], expected) <= TOLERANCE, (s, step)


@pytest.mark.parametrize("kv_dtype", list(KV_TOLERANCES))
def test_smaller_cache_dtypes_stay_close_to_f32(gguf_model, kv_dtype):
    prompts = context_prompts(gguf_model)
    fed, exact = run_together(gguf_model, prompts, None)
    _, approximate = run_together(gguf_model, prompts, fed, kv_dtype)
    tolerance = KV_TOLERANCES[kv_dtype]
    for s in range(len(prompts)):
        for step in range(CONTEXT_STEPS + 1):
            assert max_diff(approximate[s][step], exact[s][step]) <= tolerance, (s, step)
            # A random model's two best logits can be 0.01 apart, closer than a q8_0 cache's error: the
            # greedy choice must only hold where f32 is clear about it.
            top2 = exact[s][step].topk(2).values
            if top2[0] - top2[1] > tolerance:
                assert int(approximate[s][step].argmax()) == int(exact[s][step].argmax()), (s, step)


@pytest.mark.parametrize("delta", [5, -7])
def test_shifted_sequence_equals_one_computed_at_the_shifted_positions(ours, delta):
    """seq_add re-rotates cached K: it must be the rotation the forward used, scaled RoPE included."""
    start = ORIGINAL_POSITIONS - 10
    tokens = token_ids(ours.config.vocab_size, 30, seed=7)  # positions 54..83, across the original length
    ctx = new_context(ours)
    decode_ok(ctx, Batch.for_sequence(tokens, start_pos=start))
    ctx.memory.seq_add(0, -1, -1, delta)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (start + delta, start + delta + len(tokens) - 1)
    decode_ok(ctx, Batch.for_sequence([42]))
    fresh = new_context(ours)
    decode_ok(fresh, Batch.for_sequence(tokens + [42], start_pos=start + delta))
    assert max_diff(ctx.get_logits_ith(-1), fresh.get_logits_ith(-1)) <= TOLERANCE


def test_failure_in_micro_batch_two_of_three_rolls_everything_back(gguf_model, monkeypatch, fail_forward_at):
    prompts = context_prompts(gguf_model)
    first, failing, after = prompts[1], prompts[0][:40], prompts[2][:5]

    def decoded_after(ctx) -> torch.Tensor:
        decode_ok(ctx, Batch.for_sequence(after, seq_id=2))
        return ctx.get_logits_ith(-1).clone()

    clean = new_context(gguf_model, n_ubatch=16)
    decode_ok(clean, Batch.for_sequence(first, seq_id=0))
    expected_state, expected_logits = memory_state(clean), decoded_after(clean)

    ctx = new_context(gguf_model, n_ubatch=16)
    decode_ok(ctx, Batch.for_sequence(first, seq_id=0))
    before = memory_state(ctx)
    fail_forward_at(gguf_model.decoder, 2)
    assert ctx.decode(Batch.for_sequence(failing, seq_id=1)) == DecodeStatus.COMPUTE_FAILED
    assert "micro-batch 2 of 3" in ctx.last_error
    monkeypatch.undo()
    assert memory_state(ctx) == before == expected_state
    assert torch.equal(decoded_after(ctx), expected_logits)


def test_sequence_state_round_trip(gguf_model):
    prompts = context_prompts(gguf_model)
    ctx = new_context(gguf_model)
    decode_ok(ctx, Batch.for_sequence(prompts[0], seq_id=0))
    blob = ctx.state_seq_save(0)
    decode_ok(ctx, Batch.for_sequence([42], seq_id=0))
    expected = ctx.get_logits_ith(-1).clone()
    other = new_context(gguf_model)
    decode_ok(other, Batch.for_sequence(prompts[1], seq_id=0))
    other.state_seq_load(blob, 3)
    assert other.state_seq_save(3) == blob  # the stored bytes come back exactly
    decode_ok(other, Batch.for_sequence([42], seq_id=3))
    # Beside another sequence the kernels see other shapes: equal within float tolerance, not bit for bit.
    assert max_diff(other.get_logits_ith(-1), expected) <= TOLERANCE
