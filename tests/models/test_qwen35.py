"""Qwen3.5 against transformers on random-weight models it builds (tests/helpers/qwen35_factory.py): three Gated
DeltaNet layers then one gated full-attention layer, twice, value heads twice the key heads, RoPE over a quarter of
each head. From its Qwen3_5ForCausalLM folder, from the text part of a Qwen3_5ForConditionalGeneration folder, and
from GGUF files written as llama.cpp's converter writes them (value heads tiled, norms with their +1,
A = -exp(A_log)); the MoE model (experts on every layer, delta-rule layers included) likewise. Context, rollback, state
save/load and the engine run through tests/models/test_recurrent_models.py, which takes Qwen3.5 as one of its
families."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType

from helpers.models import (
    assert_greedy_generate_equals_transformers, full_sequence_logits, llama_cpp_logits, max_diff,
    prefill_then_decode_logits, reference_logits, token_ids,
)
from helpers.qwen35_factory import (
    random_qwen35, random_qwen35_moe, save_qwen35_folder, save_qwen35_moe_folder, save_qwen35_vl_folder,
    write_qwen35_gguf, write_qwen35moe_gguf,
)
from kvlm import load_model
from kvlm.memory.hybrid import HybridMemory
from kvlm.memory.layout import memory_layout

TOLERANCE = 1e-4
N_PROMPT = 150  # over two delta-rule blocks (kvlm.model.recurrent.DELTA_CHUNK = 64) and transformers' chunks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference():
    return random_qwen35()


@pytest.fixture(scope="module")
def prompt():
    return token_ids(1000, N_PROMPT, seed=35)


@pytest.fixture(scope="module")
def expected(reference, prompt):
    return reference_logits(reference, prompt)


@pytest.fixture(scope="module")
def files(reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35")
    return {"hf": save_qwen35_folder(reference, folder / "hf"),
            "vl": save_qwen35_vl_folder(reference, folder / "vl"),
            "gguf": write_qwen35_gguf(reference, folder / "model.gguf"),
            "q8_0": write_qwen35_gguf(reference, folder / "q8.gguf", GGMLQuantizationType.Q8_0)}


@pytest.fixture(scope="module", params=["hf", "vl", "gguf"])
def source(request):
    return request.param


@pytest.fixture(scope="module")
def ours(source, files):
    return load_model(str(files[source]), "float32")


def test_config_reads_the_pattern_and_the_sizes(ours, source):
    c = ours.config
    assert c.layer_kinds == ("gated_delta",) * 3 + ("attention",) + ("gated_delta",) * 3 + ("attention",)
    assert (c.ssm_groups, c.ssm_heads, c.ssm_state, c.ssm_inner, c.conv_kernel) == (2, 4, 16, 64, 4)
    assert (c.n_head, c.n_head_kv, c.head_dim, c.rotary_dims) == (4, 2, 32, 8)
    assert c.ssm_heads_tiled == (source == "gguf")  # llama.cpp's converter tiles them; transformers groups them


def test_logits_equal_transformers_prefill_and_decode(ours, prompt, expected):
    """The whole prompt as one batch, then its last 30 tokens fed one by one after the rest."""
    assert max_diff(full_sequence_logits(ours, prompt), expected) <= TOLERANCE
    stepped = prefill_then_decode_logits(ours, prompt, N_PROMPT - 30)
    assert max_diff(stepped, expected[-stepped.shape[0]:]) <= TOLERANCE


def test_the_memory_is_hybrid_and_sized_by_the_formula(ours):
    """Two attention layers' K/V rows; per sequence, each of the six delta-rule layers' convolution inputs (3 x
    (2 x 2 x 16 + 64) channels) and 4 value heads' 16 x 16 states, float32."""
    from kvlm import Context

    ctx = Context(ours, n_ctx=64, n_seq_max=2)
    assert isinstance(ctx.memory, HybridMemory)
    layout = memory_layout(ours.config, 64, n_seq_max=2)
    assert [len(pool.layers) for pool in layout.pools] == [2]
    assert layout.state_bytes == 6 * (128 * 3 + 4 * 16 * 16) * 4
    assert [tuple(s.shape) for s in ctx.memory.recurrent.banks[0]] == [(2, 2, 128, 3), (2, 2, 4, 16, 16)]  # 2 banks


def test_greedy_generate_of_several_requests_equals_transformers(files, reference):
    prompts = [token_ids(1000, n, seed=350 + n) for n in (5, 70, 33)]
    assert_greedy_generate_equals_transformers(files["gguf"], reference, prompts, n_tokens=12, n_ctx=256)


def test_a_quantized_file_runs_natively_close_to_its_dequantized_values(files, prompt):
    """Q8_0 GGUF: the reference mode (float32, gguf's dequantized values) against the default mode (the file's
    blocks through the native kernels, int8 products): close, not equal."""
    ids = prompt[:80]
    exact = full_sequence_logits(load_model(str(files["q8_0"]), "float32"), ids)
    fast = full_sequence_logits(load_model(str(files["q8_0"])), ids)
    assert max_diff(fast, exact) <= 0.05 * exact.abs().max()


# --- each mechanism broken on purpose: the comparison with transformers must notice ---

@pytest.fixture()
def fresh(files):
    return load_model(str(files["gguf"]), "float32")


def _diff(model, prompt, expected) -> float:
    return max_diff(full_sequence_logits(model, prompt[:80]), expected[:80])


def test_without_the_output_gate_the_logits_differ(fresh, prompt, expected, monkeypatch):
    monkeypatch.setattr(fresh.decoder.ops, "sigmoid_gate", lambda x, gate: x)  # the attention's output gate open
    assert _diff(fresh, prompt, expected) > 1e-2


def test_grouped_value_heads_read_from_a_gguf_file_differ(fresh, prompt, expected):
    for layer in fresh.decoder.layers:
        if hasattr(layer, "mixer"):
            layer.mixer.v_heads_tiled = False
    assert _diff(fresh, prompt, expected) > 1e-2


def test_a_wrong_layer_pattern_differs(fresh, prompt, expected):
    decoder = fresh.decoder
    kinds = list(decoder.config.layer_kinds)
    kinds[2], kinds[3] = kinds[3], kinds[2]  # attention one layer early
    layers = decoder.layers
    layers[2], layers[3] = layers[3], layers[2]
    object.__setattr__(decoder.config, "layer_kinds", tuple(kinds))
    assert _diff(fresh, prompt, expected) > 1e-2


def test_rope_over_the_whole_head_differs(fresh, prompt, expected):
    from kvlm.core.rope import Rope

    whole = Rope(fresh.config.rope, fresh.config.head_dim)
    fresh.decoder._layer_ropes = lambda n_ctx: [whole] * fresh.config.n_layer
    assert _diff(fresh, prompt, expected) > 1e-2


# --- Qwen3.5-MoE ---

@pytest.fixture(scope="module")
def moe_reference():
    return random_qwen35_moe(seed=3)


@pytest.mark.parametrize("source", ["hf", "gguf", "gguf-fused"])
def test_moe_logits_equal_transformers(moe_reference, source, tmp_path):
    writers = {"hf": lambda: save_qwen35_moe_folder(moe_reference, tmp_path / "hf"),
               "gguf": lambda: write_qwen35moe_gguf(moe_reference, tmp_path / "moe.gguf"),
               "gguf-fused": lambda: write_qwen35moe_gguf(moe_reference, tmp_path / "fused.gguf", layout="fused")}
    path = writers[source]()
    model = load_model(str(path), "float32")
    assert model.config.n_expert == 4 and all(model.config.moe_layers)
    ids = token_ids(1000, 90, seed=36)
    expected = reference_logits(moe_reference, ids)
    assert max_diff(full_sequence_logits(model, ids), expected) <= TOLERANCE
    stepped = prefill_then_decode_logits(model, ids, 80)
    assert max_diff(stepped, expected[-stepped.shape[0]:]) <= TOLERANCE


def test_llama_cpp_reads_the_gguf_file_alike(files):
    """llama.cpp (llama-cpp-python) on the same F32 file: kvlm's logits are llama.cpp's within its f16 KV cache's
    rounding, which checks the file's reading (value heads tiled, A, the norms' +1, the gate, the quarter RoPE its
    multimodal sections give for text) against the engine the format is made for."""
    ids = token_ids(1000, 40, seed=37)
    theirs = llama_cpp_logits(files["gguf"], ids)
    ours = full_sequence_logits(load_model(str(files["gguf"]), "float32"), ids)
    assert max_diff(ours, theirs) <= 0.005  # 5e-4 here


def test_tensor_parallelism_is_refused_by_name(files):
    """The recurrent states are not split between ranks (as for LFM2 and Mamba2): refused before any weight is read."""
    from kvlm.loader.hf_folder import open_hf_folder
    from kvlm.loader.shard import check_tensor_parallel

    config = open_hf_folder(files["hf"])[0]
    with pytest.raises(ValueError, match="tensor parallelism is not supported for models with gated_delta layers"):
        check_tensor_parallel(config, 2)
