"""Gemma 4 text against transformers, on random models transformers makes (tests/helpers/gemma4_factory.py): 8 layers
of 3 sliding-window layers then 1 full one, twice; full layers with their own head size (64 against 32) and
"proportional" RoPE; the last 4 layers reading the K/V of layers 2 (sliding) and 3 (full); per-layer inputs;
double-wide MLPs on the shared layers; a final logit cap. Read from save_pretrained's folder, from config.json as
google's releases write it, from a Gemma4ForConditionalGeneration folder (vision and audio towers beside) and from a
GGUF file written as llama.cpp's converter writes it; variants with K = V full layers, without sharing and per-layer
inputs, and with experts beside the MLP. Each mechanism broken on purpose must make a test fail."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from gguf import GGMLQuantizationType

import kvlm.cli.commands
from helpers.gemma4_factory import (
    random_gemma4, random_gemma4_moe, save_gemma4_folder, save_gemma4_multimodal_folder, write_gemma4_gguf,
)
from helpers.models import (
    assert_greedy_generate_equals_transformers, assert_same_state, decode_ok, full_sequence_logits, llama_cpp_logits,
    max_diff, pool_state, prefill_then_decode_logits, reference_logits, token_ids,
)
from kvlm import LLM, Batch, Context, DecodeStatus, SamplingParams, load_model
from kvlm.core.family import ATTENTION, SLIDING
from kvlm.core.config import ModelConfig
from kvlm.memory.iswa import ISWAMemory
from kvlm.memory.kv_store import BYTES_PER_ELEMENT
from kvlm.model import settings
from kvlm.model.cpu import CpuFeatures
from kvlm.memory.layout import memory_bytes

TOLERANCE = 1e-4
N_PROMPT = 60  # past the sliding window (8) many times over
WINDOW = 8
# llama.cpp's own rounding: ggml's GELU from an f16 table, its f16 KV cache with queries and attention weights in f16
# (no flash attention on the CPU): 3e-3 .. 7e-3 from transformers on these models; a misread part moves logits by
# 0.5 (rope_freqs ignored) to 2.5 (no layer_output_scale)
LLAMA_CPP_TOLERANCE = 0.02

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference():
    return random_gemma4()


@pytest.fixture(scope="module")
def prompt():
    return token_ids(1024, N_PROMPT, seed=4)


@pytest.fixture(scope="module")
def expected(reference, prompt):
    return reference_logits(reference, prompt)


@pytest.fixture(scope="module")
def files(reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4")
    return {"hf": save_gemma4_folder(reference, folder / "hf"),
            "hub": save_gemma4_folder(reference, folder / "hub", hub_config=True),
            "multimodal": save_gemma4_multimodal_folder(reference, folder / "multimodal"),
            "gguf": write_gemma4_gguf(reference, folder / "model.gguf"),
            "q8_0": write_gemma4_gguf(reference, folder / "q8.gguf", GGMLQuantizationType.Q8_0)}


@pytest.fixture(scope="module", params=["hf", "hub", "multimodal", "gguf"])
def source(request):
    return request.param


@pytest.fixture(scope="module")
def ours(source, files):
    return load_model(str(files[source]), "float32")


def test_config_reads_each_kind_the_sharing_and_the_per_layer_inputs(ours):
    c = ours.config
    assert c.layer_kinds == ((SLIDING,) * 3 + (ATTENTION,)) * 2
    assert c.attention_geometry(SLIDING) == (2, 32) and c.attention_geometry(ATTENTION) == (2, 64)
    assert c.n_kv_shared == 4 and c.kv_layers == (0, 1, 2, 3)
    assert [c.kv_source(i) for i in range(8)] == [0, 1, 2, 3, 2, 2, 2, 3]
    assert c.per_layer_embd == 16 and c.layer_n_ff == (96,) * 4 + (192,) * 4
    assert c.final_logit_softcap == 30.0 and not c.full_v_is_k
    # proportional RoPE: 8 of the full heads' 32 frequencies turn (the others' factor stops them)
    factors = c.rope.freq_factors
    assert factors[:8] == (1.0,) * 8 and min(factors[8:]) >= 1e29 and len(factors) == 32
    assert c.rope_local.freq_factors is None


def test_logits_equal_transformers_prefill_and_decode(ours, prompt, expected):
    assert max_diff(full_sequence_logits(ours, prompt), expected) <= TOLERANCE
    stepped = prefill_then_decode_logits(ours, prompt, N_PROMPT - 20)
    assert max_diff(stepped, expected[N_PROMPT - 21:]) <= TOLERANCE


def kv_row_bytes(config: ModelConfig, kind: str, dtype: str) -> float:
    """K and V of one cell in one layer of a kind."""
    n_kv, head_dim = config.attention_geometry(kind)
    return 2 * n_kv * head_dim * BYTES_PER_ELEMENT[dtype]


def test_kv_bytes_count_only_the_layers_that_write_them(files):
    """Layers 4..7 read layers 2 and 3's K/V: the memory holds rows for layers 0..3 alone (full: layer 3 with its
    64-wide heads; sliding: layers 0..2), in iSWA's pools and with swa_full's, and memory_bytes says the same."""
    model = load_model(str(files["hf"]), "float32")
    c = model.config
    ctx = Context(model, n_ctx=256, n_ubatch=7, n_seq_max=3, kv_dtype="f16")
    assert isinstance(ctx.memory, ISWAMemory)
    full, sliding = ctx.memory.pools
    assert (full.store.n_layer, sliding.store.n_layer) == (1, 3)
    assert (full.store.shape[2:], sliding.store.shape[2:]) == ((2, 64), (2, 32))
    expected = 1 * 256 * kv_row_bytes(c, ATTENTION, "f16") + 3 * (WINDOW * 3 + 7) * kv_row_bytes(c, SLIDING, "f16")
    assert ctx.memory.kv_bytes == expected == memory_bytes(c, 256, 3, "f16", n_ubatch=7)
    kept = Context(model, n_ctx=256, n_ubatch=7, n_seq_max=3, kv_dtype="f16", swa_full=True).memory
    every_cell = 256 * (kv_row_bytes(c, ATTENTION, "f16") + 3 * kv_row_bytes(c, SLIDING, "f16"))
    assert kept.kv_bytes == every_cell == memory_bytes(c, 256, 3, "f16", n_ubatch=7, swa_full=True)


def test_inspect_prints_the_bytes_the_sharing_saves(files, capsys):
    assert kvlm.cli.commands.main(["inspect", str(files["gguf"]), "--ctx", "512"]) == 0
    rows = {line[:20].strip(): line[20:].strip() for line in capsys.readouterr().out.splitlines()}
    config = load_model(str(files["gguf"]), "float32").config
    saved = 512 * (3 * kv_row_bytes(config, SLIDING, "f16") + kv_row_bytes(config, ATTENTION, "f16"))
    assert rows["kv sharing"].startswith(f"layers 4..7 read the K/V of layers 2, 3 and hold none: {int(saved)} (")
    assert rows["kv memory"] == "iswa: full pool 1 layers x 512 cells, sliding pool 3 layers x 512 cells"


def test_greedy_generate_of_several_requests_equals_transformers(files, reference):
    prompts = [token_ids(1024, n, seed=40 + n) for n in (5, 23, 41)]
    assert_greedy_generate_equals_transformers(files["gguf"], reference, prompts, n_tokens=16, n_ctx=128)


def test_swa_full_keeps_every_cell_in_two_pools_with_the_same_logits(files, prompt, expected):
    model = load_model(str(files["hf"]), "float32")
    ctx = Context(model, n_ctx=64, n_batch=64, n_ubatch=64, swa_full=True)
    assert [pool.n_cells for pool in ctx.memory.pools] == [64, 64]
    decode_ok(ctx, Batch(tokens=list(prompt), logits=[True] * len(prompt)))
    assert max_diff(torch.stack([ctx.get_logits_ith(i) for i in range(len(prompt))]), expected) <= TOLERANCE


def test_a_failed_batch_restores_everything_and_reruns(files, prompt, expected, monkeypatch, fail_forward_at):
    model = load_model(str(files["hf"]), "float32")
    ctx = Context(model, n_ctx=128, n_batch=128, n_ubatch=7, n_seq_max=2)
    decode_ok(ctx, Batch.for_sequence(prompt[:20]))
    before = pool_state(ctx)
    fail_forward_at(model.decoder, 3)
    assert ctx.decode(Batch.for_sequence(prompt[20:50])) == DecodeStatus.COMPUTE_FAILED
    assert_same_state(pool_state(ctx), before)
    monkeypatch.undo()
    decode_ok(ctx, Batch.for_sequence(prompt[20:50]))
    assert max_diff(ctx.get_logits_ith(-1), expected[49]) <= TOLERANCE


def test_rollback_of_a_tail_then_a_saved_sequence_continues_in_another_context(files, prompt, expected):
    """Decode a wrong tail, take it back with seq_rm (the sliding pool kept enough cells: within its window), decode
    the right one; save the sequence, load it into another context's sequence 1 and continue there."""
    model = load_model(str(files["hf"]), "float32")
    ctx = Context(model, n_ctx=128, n_batch=128, n_ubatch=16, n_seq_max=2)
    decode_ok(ctx, Batch.for_sequence(prompt[:30]))
    decode_ok(ctx, Batch.for_sequence(token_ids(1024, 3, seed=99), start_pos=30))
    assert ctx.memory.seq_rm(0, 30, -1)
    decode_ok(ctx, Batch.for_sequence(prompt[30:40], start_pos=30))
    assert max_diff(ctx.get_logits_ith(-1), expected[39]) <= TOLERANCE
    blob = ctx.state_seq_save(0)
    other = Context(model, n_ctx=128, n_batch=128, n_ubatch=16, n_seq_max=2)
    other.state_seq_load(blob, 1)
    decode_ok(other, Batch.for_sequence(prompt[40:], seq_id=1, start_pos=40))
    assert max_diff(other.get_logits_ith(-1), expected[-1]) <= TOLERANCE


def test_the_default_mode_equals_transformers(files, prompt, expected, monkeypatch):
    """The default mode of a CPU without native bf16 (float32 activations, the file's matrices read natively; such
    a CPU is what the settings see here, so that a bf16 CPU runs the same) on the F32 file: native layer ops (norms,
    QK-norm, RoPE over the 64-wide full heads) and native decode attention, over its f32 cache (measured 4.7e-6)
    and over an f16 one (its rounding, 5e-3)."""
    monkeypatch.setattr(settings, "detect", lambda: CpuFeatures("a CPU without native bf16", "AVX2", frozenset()))
    model = load_model(str(files["gguf"]))
    assert model.decoder.settings.dtype == "float32"
    stepped = prefill_then_decode_logits(model, prompt, N_PROMPT - 20)
    assert max_diff(stepped, expected[N_PROMPT - 21:]) <= TOLERANCE
    in_f16 = prefill_then_decode_logits(model, prompt, N_PROMPT - 20, kv_dtype="f16")
    assert max_diff(in_f16, expected[N_PROMPT - 21:]) <= 5e-3


def test_the_engine_reuses_a_prefix_and_preempts_with_the_same_outputs(files):
    """A continuation of a finished conversation borrows its cells (both pools, the shared layers reading the
    borrowed rows of their producers), and a small memory preempts and recomputes: every output equals its run
    without prefix caching, alone."""
    model = load_model(str(files["hf"]), "float32")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = token_ids(1024, 40, seed=41)
    llm = LLM(model, n_ctx=128, max_num_seqs=3, max_num_batched_tokens=16)
    out_first = llm.generate([first], params, use_tqdm=False)[0]
    follow_up = first + out_first.token_ids + token_ids(1024, 6, seed=42)
    others = [token_ids(1024, 30 + 3 * i, seed=43 + i) for i in range(4)]
    outputs = llm.generate([follow_up, *others], params, use_tqdm=False)
    assert outputs[0].n_cached_tokens >= len(first) + len(out_first.token_ids) - 16
    assert llm.engine.scheduler.n_preemptions > 0
    alone = LLM(model, n_ctx=128, max_num_seqs=1, enable_prefix_caching=False)
    for prompt, output in zip([first, follow_up, *others], [out_first, *outputs]):
        assert output.token_ids == alone.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_a_quantized_file_runs_natively_close_to_its_dequantized_values(files, prompt):
    """Q8_0 products quantize their activations to 8 bits too (as llama.cpp's): on a 64-wide random model that moves
    the logits by ~0.2 (llama.cpp on the same file: ~0.2 from the dequantized values as well); a mistake moves them by
    about their whole range."""
    ids = prompt[:40]
    exact = full_sequence_logits(load_model(str(files["q8_0"]), "float32"), ids)
    fast = full_sequence_logits(load_model(str(files["q8_0"])), ids)
    assert max_diff(fast, exact) <= 0.1 * exact.abs().max()


def test_llama_cpp_reads_the_gguf_file_alike(files, prompt):
    """llama.cpp (llama-cpp-python) on the same F32 file reads it as kvlm does: its shared layers read layers
    n_kv - 2 and n_kv - 1 (here transformers' choice too), its logits within LLAMA_CPP_TOLERANCE of kvlm's."""
    ids = prompt[:40]
    theirs = llama_cpp_logits(files["gguf"], ids)
    assert max_diff(full_sequence_logits(load_model(str(files["gguf"]), "float32"), ids), theirs) <= LLAMA_CPP_TOLERANCE


def test_the_multimodal_folder_loads_its_language_model_and_names_the_towers_it_leaves(files, caplog):
    with caplog.at_level(logging.WARNING):
        load_model(str(files["multimodal"]), "float32")
    assert "vision tower and audio tower" in caplog.text and "text only" in caplog.text


def test_tensor_parallelism_is_refused_by_name(files):
    with pytest.raises(ValueError, match="tensor parallelism is not supported for gemma4 models"):
        load_model(str(files["gguf"]), "float32", tensor_parallel_size=2)


# --- the variants: K = V full layers, no sharing and no per-layer inputs, experts beside the MLP ---

VARIANTS = {"k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
            "plain": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, use_double_wide_mlp=False)}


@pytest.fixture(scope="module", params=["k_eq_v", "plain", "moe"])
def variant(request, tmp_path_factory):
    name = request.param
    model = random_gemma4_moe(seed=5) if name == "moe" else random_gemma4(seed=6, **VARIANTS[name])
    folder = tmp_path_factory.mktemp(f"gemma4-{name}")
    return name, model, {"hf": save_gemma4_folder(model, folder / "hf"),
                         "gguf": write_gemma4_gguf(model, folder / "model.gguf")}


@pytest.mark.parametrize("variant_source", ["hf", "gguf"])
def test_variant_logits_equal_transformers(variant, variant_source, prompt):
    name, reference, paths = variant
    model = load_model(str(paths[variant_source]), "float32")
    assert model.config.full_v_is_k == (name != "plain")
    assert bool(model.config.n_expert) == (name == "moe")
    expected = reference_logits(reference, prompt)
    assert max_diff(full_sequence_logits(model, prompt), expected) <= TOLERANCE
    stepped = prefill_then_decode_logits(model, prompt, N_PROMPT - 10)
    assert max_diff(stepped, expected[N_PROMPT - 11:]) <= TOLERANCE


def test_variant_greedy_generate_of_several_requests_equals_transformers(variant):
    _, reference, paths = variant
    prompts = [token_ids(1024, n, seed=50 + n) for n in (7, 29)]
    assert_greedy_generate_equals_transformers(paths["gguf"], reference, prompts, n_tokens=12, n_ctx=96)


def test_llama_cpp_reads_the_variant_files_alike(variant, prompt):
    """K = V full layers (no attn_v) and a model without sharing or per-layer inputs as llama.cpp reads them (the
    MoE variant aside: a token whose 2nd and 3rd experts are 1e-4 apart takes other experts in llama.cpp)."""
    name, _, paths = variant
    if name == "moe":
        pytest.skip("experts may swap under llama.cpp's rounding")
    ids = prompt[:40]
    theirs = llama_cpp_logits(paths["gguf"], ids)
    assert max_diff(full_sequence_logits(load_model(str(paths["gguf"]), "float32"), ids), theirs) <= LLAMA_CPP_TOLERANCE


# --- each mechanism broken on purpose ---

@pytest.fixture
def fresh(files):
    return lambda: load_model(str(files["hf"]), "float32")


def _diff(model, prompt, expected) -> float:
    return max_diff(full_sequence_logits(model, prompt[:40]), expected[:40])


def test_shared_layers_given_their_own_cache_break_the_byte_formula(files, monkeypatch):
    """A memory that allocated rows for the layers that read others' (every attention layer a writer) holds more
    than the formula with the producing layers alone."""
    model = load_model(str(files["hf"]), "float32")
    right = Context(model, n_ctx=64, n_ubatch=8).memory.kv_bytes
    monkeypatch.setattr(ModelConfig, "kv_layers", property(lambda c: tuple(range(c.n_layer))))
    assert Context(model, n_ctx=64, n_ubatch=8).memory.kv_bytes > right


def test_shared_layers_reading_the_wrong_producer_differ(fresh, prompt, expected, monkeypatch):
    first_of_kind = lambda c, layer: c.layer_kinds.index(c.layer_kinds[layer])  # noqa: E731
    original = ModelConfig.kv_source
    monkeypatch.setattr(ModelConfig, "kv_source", lambda c, layer: first_of_kind(c, layer)
                        if layer >= c.n_layer - c.n_kv_shared else original(c, layer))
    assert _diff(fresh(), prompt, expected) > 1e-2


def test_without_the_per_layer_inputs_the_logits_differ(fresh, prompt, expected):
    model = fresh()
    model.decoder.per_layer_inputs = None
    assert _diff(model, prompt, expected) > 1e-2


def test_without_the_layer_scalars_the_logits_differ(fresh, prompt, expected):
    model = fresh()
    for layer in model.decoder.layers:
        layer.output_scale = None
    assert _diff(model, prompt, expected) > 1e-2


@pytest.mark.parametrize("part", ["unscaled_attention", "value_norm"])
def test_without_a_family_part_the_logits_differ(files, prompt, expected, part, monkeypatch):
    family = ModelConfig.family.fget
    monkeypatch.setattr(ModelConfig, "family", property(lambda c: dataclasses.replace(family(c), **{part: False})))
    assert _diff(load_model(str(files["hf"]), "float32"), prompt, expected) > 1e-2


def test_rope_over_the_first_quarter_of_the_full_heads_differs(fresh, prompt, expected):
    """The proportional RoPE turns pairs (i, i + 32) of a 64-dim head for i < 8; a partial RoPE over the first 16
    dims (pairs (i, i + 8)) is another rotation."""
    model = fresh()
    ropes = model.decoder.layer_ropes
    full = ropes[model.config.layer_kinds.index(ATTENTION)]
    partial = type(full)(dataclasses.replace(full.scaling, freq_factors=None), 16)
    model.decoder._layer_ropes = lambda n_ctx: [partial if rope is full else rope for rope in ropes]
    assert _diff(model, prompt, expected) > 1e-2


# --- google's E2B as its config.json describes it (no weights): what transformers makes of it ---

E2B_TEXT_CONFIG = {  # google/gemma-4-E2B-it's text_config, its values as public copies of the release's config quote them
    "model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35, "num_attention_heads": 8,
    "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": None,
    "attention_k_eq_v": False, "sliding_window": 512, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
    "intermediate_size": 6144, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}}


def test_an_e2b_config_reads_as_transformers_reads_it(tmp_path):
    """Each layer's geometry, the layer each shared one reads and the MLP widths, against transformers' own
    Gemma4TextConfig of the same dict; the KV bytes then count 15 of the 35 layers."""
    import json

    from transformers import Gemma4TextConfig

    from kvlm.loader.hf_folder import config_from_hf
    raw = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": E2B_TEXT_CONFIG, "vision_config": {"hidden_size": 768}, "audio_config": {"hidden_size": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = config_from_hf(tmp_path)
    theirs = Gemma4TextConfig(**{k: v for k, v in E2B_TEXT_CONFIG.items() if k != "model_type"})
    for i, kind in enumerate(theirs.layer_types):
        layer = theirs.per_layer_config[i]
        assert ours.attention_geometry(ours.layer_kinds[i]) == (layer.num_key_value_heads, layer.head_dim)
        assert (ours.layer_kinds[i] == SLIDING) == (kind == "sliding_attention")
    modes = theirs.kv_sharing_modes
    producers = {kind: max(i for i, mode in enumerate(modes) if mode == "store" and theirs.layer_types[i] == kind)
                 for kind in set(theirs.layer_types)}
    assert [ours.kv_source(i) for i in range(35)] == [i if modes[i] != "reuse" else producers[theirs.layer_types[i]]
                                                     for i in range(35)]
    assert ours.layer_n_ff == tuple(6144 * (2 if mode == "reuse" else 1) for mode in modes)
    assert len(ours.kv_layers) == 15
    kept = memory_bytes(ours, 32768, 1, "f16", swa_full=True)
    every_layer = memory_bytes(dataclasses.replace(ours, n_kv_shared=0), 32768, 1, "f16", swa_full=True)
    assert kept == 32768 * 2 * 2 * (3 * 512 + 12 * 256) and every_layer == 32768 * 2 * 2 * (7 * 512 + 28 * 256)
