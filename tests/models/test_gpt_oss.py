"""gpt-oss against transformers: a tiny random model transformers makes, from its Hugging Face folder and from a GGUF
file written as llama.cpp's converter writes it (gptoss_factory), F32 and with MXFP4 experts.

What gpt-oss adds to a mixture of experts (attention sinks, biases on the attention output, the router and the
experts, the clamped SwiGLU, YaRN without rounding, the same RoPE on sliding layers, a window on every other layer)
each moves logits far past the tolerance when dropped: each is broken on purpose below and must fail."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType

from helpers.gptoss_factory import (
    WINDOW, load_gguf_experts_into, random_gpt_oss, save_gpt_oss_folder, save_mxfp4_folder, write_gpt_oss_gguf,
)
from helpers.models import (
    assert_greedy_generate_equals_transformers, decode_ok, full_sequence_logits, llama_cpp_logits, max_diff,
    prefill_then_decode_logits, reference_logits, token_ids,
)
from kvlm import Batch, Context, load_model
from kvlm.core.family import ATTENTION, SLIDING
from kvlm.kernels import BlockMatrix, native_kernels
from kvlm.model.moe import BlockExperts

TOLERANCE = 1e-4
N_GREEDY = 12
SOURCES = ("hf", "gguf")
MXFP4 = GGMLQuantizationType.MXFP4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference():
    return random_gpt_oss()


@pytest.fixture(scope="module")
def paths(reference, tmp_path_factory) -> dict[str, object]:
    folder = tmp_path_factory.mktemp("gpt-oss")
    return {"hf": save_gpt_oss_folder(reference, folder / "hf"), "gguf": write_gpt_oss_gguf(reference, folder / "f32.gguf"),
            "mxfp4": write_gpt_oss_gguf(reference, folder / "mxfp4.gguf", MXFP4),
            "all-mxfp4": write_gpt_oss_gguf(reference, folder / "all-mxfp4.gguf", MXFP4, all_matrices=True)}


@pytest.fixture(scope="module")
def models(paths) -> dict[str, object]:
    return {source: load_model(str(paths[source]), "float32", progress=False) for source in SOURCES}


@pytest.fixture(params=SOURCES)
def source(request) -> str:
    return request.param


def test_both_sources_read_the_same_model(models, reference):
    hf = reference.config
    for model in models.values():
        c = model.config
        assert (c.architecture, c.n_expert, c.n_expert_used, c.n_ff_exp) == ("gpt-oss", 6, 2, hf.intermediate_size)
        assert c.layer_kinds == (SLIDING, ATTENTION) * 2 and c.sliding_window == WINDOW
        assert c.rope_local is None and c.rope.kind == "yarn" and c.rope.truncate is False
        assert c.expert_weights_norm and (c.swiglu_alpha, c.swiglu_limit) == (1.702, 7.0)


def test_logits_match_transformers(models, source, reference):
    """48 tokens: six times the window, so the sliding layers' masks are exercised too."""
    model = models[source]
    ids = token_ids(model.config.vocab_size, 48, seed=3)
    expected = reference_logits(reference, ids)
    assert max_diff(full_sequence_logits(model, ids), expected) <= TOLERANCE
    assert max_diff(prefill_then_decode_logits(model, ids, 36), expected[35:]) <= TOLERANCE


def test_greedy_llm_generate_equals_transformers_generate(paths, source, reference):
    prompts = [token_ids(reference.config.vocab_size, n, seed=n + 1) for n in (5, 40, 17)]
    assert_greedy_generate_equals_transformers(paths[source], reference, prompts, N_GREEDY, n_ctx=128)


def new_context(model, **kwargs) -> Context:
    return Context(model, **{"n_ctx": 128, "n_batch": 128, "n_ubatch": 16, "n_seq_max": 4, **kwargs})


def test_context_rollback_and_state_of_several_sequences(models):
    """Three sequences in micro-batches of 16; one rolled back by seq_rm and continued otherwise: it equals a
    context that computed only what it kept; the others equal each computed alone."""
    model = models["gguf"]
    prompts = [token_ids(model.config.vocab_size, n, seed=50 + n) for n in (30, 9, 21)]
    ctx = new_context(model)
    decode_ok(ctx, Batch(tokens=[t for p in prompts for t in p], seq_ids=[s for s, p in enumerate(prompts) for _ in p],
                         logits=[True] * sum(map(len, prompts))))
    decode_ok(ctx, Batch.for_sequence([7, 8, 9], seq_id=1, start_pos=len(prompts[1])))
    assert ctx.memory.seq_rm(1, len(prompts[1]), -1)  # rolled back to its prompt
    decode_ok(ctx, Batch(tokens=[42, 43, 44], seq_ids=[0, 1, 2],
                         pos=[len(p) for p in prompts], logits=[True] * 3))
    for s, token in enumerate((42, 43, 44)):
        fresh = new_context(model)
        decode_ok(fresh, Batch.for_sequence(prompts[s] + [token]))
        assert max_diff(ctx.get_logits_ith(s), fresh.get_logits_ith(-1)) <= TOLERANCE


def test_mxfp4_experts_are_read_exactly(paths, reference):
    """A file with MXFP4 experts (the form OpenAI releases them in): the reference mode reads gguf's exact values
    (transformers holding the same values gives the same logits); the default setting keeps the file's MXFP4
    blocks (no requantization, no dense copy) and multiplies them natively, close to the reference."""
    exact = load_model(str(paths["mxfp4"]), "float32", progress=False)
    expected_model = load_gguf_experts_into(reference, paths["mxfp4"])
    ids = token_ids(exact.config.vocab_size, 40, seed=5)
    expected = reference_logits(expected_model, ids)
    assert max_diff(full_sequence_logits(exact, ids), expected) <= TOLERANCE
    if native_kernels() is None:
        return
    fast = load_model(str(paths["mxfp4"]), progress=False)
    for layer in fast.decoder.layers:
        assert isinstance(layer.moe.experts, BlockExperts)
        assert {b.qtype for b in layer.moe.experts.blocks if isinstance(b, BlockMatrix)} == {MXFP4}
    approximate = full_sequence_logits(fast, ids)
    per_token = (approximate - expected).abs().amax(dim=-1)
    assert per_token.median().item() <= 0.1 * expected.abs().max().item()
    assert (approximate.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.75


def test_openai_mxfp4_folder_reads_as_the_mxfp4_gguf_file(paths, reference, tmp_path):
    """OpenAI's own folder layout (MXFP4 blocks and scales, nibbles in pairs, gate/up rows interleaved): transformers'
    dequantizer reads the blocks written here as gguf reads the GGUF file's (so the folder is laid out as OpenAI's);
    kvlm's reference mode gives transformers' logits on those values, and its default setting holds the very
    blocks of the GGUF file, so its logits are that file's, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from safetensors import safe_open

    folder = save_mxfp4_folder(reference, tmp_path / "mxfp4")
    expected_model = load_gguf_experts_into(reference, paths["mxfp4"])
    with safe_open(folder / "model.safetensors", "pt") as f:
        values = convert_moe_packed_tensors(f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_blocks"),
                                            f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_scales"),
                                            dtype=torch.float32)
    assert torch.equal(values, expected_model.model.layers[1].mlp.experts.gate_up_proj)  # both [expert, in, out]
    ids = token_ids(reference.config.vocab_size, 40, seed=6)
    exact = load_model(str(folder), "float32", progress=False)
    assert max_diff(full_sequence_logits(exact, ids), reference_logits(expected_model, ids)) <= TOLERANCE
    if native_kernels() is not None:
        from_folder, from_file = (load_model(str(path), progress=False) for path in (folder, paths["mxfp4"]))
        assert torch.equal(full_sequence_logits(from_folder, ids), full_sequence_logits(from_file, ids))


def test_fused_decode_layer_with_sinks_equals_the_layer_op_by_op(paths):
    """Decode steps of the default setting: the fused native layer (sinks, output bias) against the same layers run op
    by op with the same native ops and products: the same arithmetic in the same order, so the logits are equal bit
    for bit on any CPU (the native decode attention's sinks against their definition: test_layer_ops.py)."""
    if native_kernels() is None:
        pytest.skip("the native kernels are not built here")
    model = load_model(str(paths["all-mxfp4"]), progress=False)
    ids = token_ids(model.config.vocab_size, 30, seed=8)
    fused = prefill_then_decode_logits(model, ids, 20)
    layers, model.decoder.decode_layers = model.decoder.decode_layers, None
    try:
        op_by_op = prefill_then_decode_logits(model, ids, 20)
    finally:
        model.decoder.decode_layers = layers
    assert layers.layers, "the fused layers were not used"
    assert torch.equal(fused, op_by_op)


def test_llama_cpp_reads_the_gguf_file_alike_but_for_yarn_rounding(paths, models):
    """llama.cpp (llama-cpp-python) on the same F32 file: with YaRN's correction range rounded as llama.cpp rounds
    it, kvlm's logits are llama.cpp's (within its f16 KV cache's rounding), which checks the file's reading (sinks,
    windows, biases, clamp, router) against the engine the format is made for; kvlm's default does not round, as
    OpenAI's reference and transformers (the test above): on this model's short original context that moves the
    logits by whole units."""
    ids = token_ids(1000, 20, seed=3)
    theirs = llama_cpp_logits(paths["gguf"], ids)
    model = load_model(str(paths["gguf"]), "float32", progress=False)
    assert max_diff(full_sequence_logits(model, ids), theirs) > 1.0
    _rounded_yarn(model)
    assert max_diff(full_sequence_logits(model, ids), theirs) <= 0.05


# --- each of gpt-oss's parts broken on purpose ---

def _layers(model):
    return model.decoder.layers


def _rounded_yarn(model):
    """YaRN's correction range rounded to whole dimensions, as llama.cpp rounds it."""
    c = model.decoder.config
    model.decoder.config = replace(c, rope=replace(c.rope, truncate=True))  # the next context's RoPE


BREAKAGES = {
    "sinks dropped": lambda m: [setattr(layer, "sinks", None) for layer in _layers(m)],
    "output bias dropped": lambda m: [setattr(layer, "output_bias", None) for layer in _layers(m)],
    "router bias dropped": lambda m: [setattr(layer.moe, "router_bias", None) for layer in _layers(m)],
    "expert biases dropped": lambda m: [setattr(layer.moe.experts, "biases", None) for layer in _layers(m)],
    "no clamp": lambda m: [setattr(layer.moe.experts, "swiglu", (1.702, math.inf)) for layer in _layers(m)],
    "yarn rounded": _rounded_yarn,
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_each_part_broken_on_purpose_fails(paths, reference, breakage):
    model = load_model(str(paths["hf"]), "float32", progress=False)
    ids = token_ids(model.config.vocab_size, 40, seed=9)
    expected = reference_logits(reference, ids)
    assert max_diff(full_sequence_logits(model, ids), expected) <= TOLERANCE
    BREAKAGES[breakage](model)
    assert max_diff(full_sequence_logits(model, ids), expected) > 100 * TOLERANCE
