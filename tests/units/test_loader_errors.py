"""Broken model files give a ModelFileError naming the file and what is wrong, never a low-level error."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers.gguf_factory import gguf_metadata, gguf_tensors, llama_config, random_llama, write_gguf
from kvlm.core.errors import ModelFileError, UnsupportedModelError
from kvlm.loader.load import load_model
from kvlm.core.config import ModelConfig
from kvlm.loader.gguf_file import open_gguf_model, read_gguf_config
from kvlm.loader.hf_folder import open_hf_folder
from kvlm.loader.tensors import GGUFTensors, SafetensorsTensors


@pytest.fixture(scope="module")
def tiny():
    return random_llama(llama_config(vocab_size=300, hidden_size=32, n_head=2, n_head_kv=1, intermediate_size=64))


def assert_file_error(load, path: Path, *details: str) -> str:
    with pytest.raises(ModelFileError) as info:
        load(path)
    message = str(info.value)
    for detail in (str(path), *details):
        assert detail in message, f"{detail!r} not in {message!r}"
    return message


# GGUF files


@pytest.fixture
def metadata(tiny) -> dict:
    return gguf_metadata(tiny.config)


@pytest.fixture
def tensors(tiny) -> dict[str, np.ndarray]:
    return gguf_tensors(tiny)


@pytest.fixture
def gguf_path(tmp_path) -> Path:
    return tmp_path / "model.gguf"


def test_the_unchanged_file_loads(gguf_path, metadata, tensors):
    """So each failure below comes from the one thing its test changed."""
    config, _, _ = open_gguf_model(write_gguf(gguf_path, metadata, tensors))
    assert (config.n_layer, config.n_head, config.n_head_kv) == (2, 2, 1)


def test_unknown_architecture_is_named_with_the_supported_ones(gguf_path, tiny, tensors):
    write_gguf(gguf_path, gguf_metadata(tiny.config, arch="mamba"), tensors, arch="mamba")
    for load in (open_gguf_model, read_gguf_config):
        assert_file_error(load, gguf_path, "'mamba'", "supported: llama")


@pytest.mark.parametrize(
    "key", ["block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length",
            "attention.layer_norm_rms_epsilon"],
)
def test_missing_metadata_key_is_named(gguf_path, metadata, tensors, key):
    del metadata[f"llama.{key}"]
    assert_file_error(open_gguf_model, write_gguf(gguf_path, metadata, tensors), f"llama.{key}", "missing")


@pytest.mark.parametrize(
    "key, value, field",
    [("attention.head_count_kv", 3, "n_head_kv"), ("block_count", 0, "n_layer"),
     ("attention.key_length", 15, "head_dim")],
)
def test_metadata_describing_an_invalid_model_is_a_file_error(gguf_path, metadata, tensors, key, value, field):
    metadata[f"llama.{key}"] = value
    assert_file_error(open_gguf_model, write_gguf(gguf_path, metadata, tensors), field)


@pytest.mark.parametrize("name", ["blk.1.ffn_up.weight", "blk.0.attn_k.weight", "output_norm.weight"])
def test_missing_tensor_is_named_with_its_shape(gguf_path, metadata, tensors, name):
    shape = list(tensors.pop(name).shape)
    assert_file_error(open_gguf_model, write_gguf(gguf_path, metadata, tensors), name, "missing", f"expected shape {shape}")


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_k.weight", "blk.1.attn_norm.weight"])
def test_wrong_tensor_shape_gives_found_and_expected(gguf_path, metadata, tensors, name):
    shape = list(tensors[name].shape)
    wrong = [shape[0] + 2, *shape[1:]]
    tensors[name] = np.zeros(wrong, dtype=np.float32)
    assert_file_error(open_gguf_model, write_gguf(gguf_path, metadata, tensors), name, f"shape {wrong}, expected {shape}")


@pytest.mark.parametrize("keep", [lambda n: n - 1, lambda n: n - 100, lambda n: n // 2, lambda n: 64, lambda n: 0],
                         ids=["last_byte", "last_100_bytes", "half", "into_metadata", "empty"])
@pytest.mark.parametrize("load", [open_gguf_model, read_gguf_config, load_model], ids=lambda f: f.__name__)
def test_truncated_file_is_a_file_error(gguf_path, metadata, tensors, keep, load):
    # gguf's reader checks every tensor's extent when it opens the file, so the open itself fails.
    data = write_gguf(gguf_path, metadata, tensors).read_bytes()
    gguf_path.write_bytes(data[: keep(len(data))])
    assert_file_error(load, gguf_path)


@pytest.mark.parametrize("contents", [np.random.default_rng(0).bytes(4096), b"GGUF" + bytes(100), b"hello\n"],
                         ids=["random_bytes", "gguf_magic_then_zeros", "text"])
def test_not_a_gguf_file(gguf_path, contents):
    gguf_path.write_bytes(contents)
    for load in (open_gguf_model, load_model):
        assert_file_error(load, gguf_path, "not a readable GGUF file")


def test_absent_file(tmp_path):
    assert_file_error(open_gguf_model, tmp_path / "absent.gguf", "no such GGUF file")


# Hugging Face folders


@pytest.fixture
def hf_config(tiny) -> dict:
    return json.loads(tiny.config.to_json_string())


@pytest.fixture
def hf_tensors(tiny) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing memory; a tied head is not saved, as transformers does.
    return {name: t.clone() for name, t in tiny.state_dict().items() if name != "lm_head.weight"}


def write_hf_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_the_unchanged_folder_loads(tmp_path, hf_config, hf_tensors):
    config, _ = open_hf_folder(write_hf_folder(tmp_path, hf_config, hf_tensors))
    assert (config.n_layer, config.n_head, config.n_head_kv) == (2, 2, 1)


def test_unsupported_model_type_is_named_with_the_supported_ones(tmp_path, hf_config, hf_tensors):
    hf_config["model_type"] = "gpt2"
    assert_file_error(open_hf_folder, write_hf_folder(tmp_path, hf_config, hf_tensors), "'gpt2'", "supported: llama")


def test_missing_folder_tensor_is_named_as_in_the_folder(tmp_path, hf_config, hf_tensors):
    name = "model.layers.1.mlp.up_proj.weight"
    shape = list(hf_tensors.pop(name).shape)
    folder = write_hf_folder(tmp_path, hf_config, hf_tensors)
    assert_file_error(open_hf_folder, folder, name, "missing", f"expected shape {shape}")


def test_wrong_folder_tensor_shape_gives_found_and_expected(tmp_path, hf_config, hf_tensors):
    name = "model.layers.0.self_attn.k_proj.weight"
    shape = list(hf_tensors[name].shape)
    hf_tensors[name] = torch.zeros(shape[0], shape[1] + 1)
    folder = write_hf_folder(tmp_path, hf_config, hf_tensors)
    assert_file_error(open_hf_folder, folder, name, f"shape {[shape[0], shape[1] + 1]}, expected {shape}")


@pytest.mark.parametrize(
    "config_text, detail",
    [("{not json", "cannot read"), ("[1, 2]", "JSON object"), ("", "cannot read")],
    ids=["broken_json", "not_an_object", "empty"],
)
def test_unreadable_config_json(tmp_path, hf_tensors, hf_config, config_text, detail):
    folder = write_hf_folder(tmp_path, hf_config, hf_tensors)
    (folder / "config.json").write_text(config_text)
    assert_file_error(open_hf_folder, folder, "config.json", detail)


def test_absent_config_json(tmp_path, hf_tensors, hf_config):
    folder = write_hf_folder(tmp_path, hf_config, hf_tensors)
    (folder / "config.json").unlink()
    assert_file_error(open_hf_folder, folder, "config.json", "cannot read")


@pytest.mark.parametrize(
    "change, detail",
    [({"hidden_size": None}, "'hidden_size'"), ({"num_key_value_heads": 3}, "n_head_kv"),
     ({"num_hidden_layers": 0}, "n_layer"), ({"num_attention_heads": "two"}, "invalid model")],
    ids=["missing_key", "kv_heads_not_dividing", "no_layers", "wrong_type"],
)
def test_config_json_describing_an_invalid_model(tmp_path, hf_tensors, hf_config, change, detail):
    hf_config.update(change)
    hf_config = {key: value for key, value in hf_config.items() if value is not None}
    assert_file_error(open_hf_folder, write_hf_folder(tmp_path, hf_config, hf_tensors), "config.json", detail)


def test_damaged_safetensors_file(tmp_path, hf_config, hf_tensors):
    folder = write_hf_folder(tmp_path, hf_config, hf_tensors)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert_file_error(open_hf_folder, folder, "model.safetensors", "not a readable safetensors file")


# ModelConfig validation

VALID = ModelConfig(
    architecture="llama", name="valid", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, head_dim=16,
    vocab_size=100, n_ctx_train=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
)


@pytest.mark.parametrize(
    "change, field",
    [({"n_head": 6, "n_head_kv": 4}, r"n_head \(6\) must be a multiple of n_head_kv \(4\)"),
     ({"head_dim": 15}, r"head_dim must be even"),
     ({"n_layer": 0}, r"n_layer must be a positive integer"),
     ({"n_head_kv": 0}, r"n_head_kv must be a positive integer"),
     ({"vocab_size": 10.5}, r"vocab_size must be a positive integer")],
    ids=["kv_heads_not_dividing", "odd_head_dim", "zero_layers", "zero_kv_heads", "fractional_vocab"],
)
def test_model_config_rejects_invalid_values_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        replace(VALID, **change)


# Families: what is not supported is refused by name before any weight is read


def test_unknown_architecture_is_a_typed_error(gguf_path, tiny, tensors, tmp_path, hf_config, hf_tensors):
    write_gguf(gguf_path, gguf_metadata(tiny.config, arch="mamba"), tensors, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="'mamba'.*supported: llama, qwen2, qwen3"):
        open_gguf_model(gguf_path)
    hf_config["architectures"] = ["GPT2LMHeadModel"]
    hf_config["model_type"] = "gpt2"
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel'.*Qwen2ForCausalLM"):
        open_hf_folder(write_hf_folder(tmp_path, hf_config, hf_tensors))


def test_a_missing_tensor_fails_before_any_weight_is_read(gguf_path, metadata, tensors, monkeypatch):
    monkeypatch.setattr(GGUFTensors, "read", lambda *args: pytest.fail("weights read"))
    del tensors["blk.1.ffn_down.weight"]  # the very last layer tensor: every other one is fine
    assert_file_error(load_model, write_gguf(gguf_path, metadata, tensors), "blk.1.ffn_down.weight", "missing")


def test_a_missing_folder_tensor_fails_before_any_weight_is_read(tmp_path, hf_config, hf_tensors, monkeypatch):
    monkeypatch.setattr(SafetensorsTensors, "read", lambda *args: pytest.fail("weights read"))
    del hf_tensors["model.layers.1.mlp.down_proj.weight"]
    folder = write_hf_folder(tmp_path, hf_config, hf_tensors)
    assert_file_error(load_model, folder, "model.layers.1.mlp.down_proj.weight", "missing")


def test_a_qwen2_file_without_its_biases_names_the_missing_bias(gguf_path, tiny, tensors):
    message = assert_file_error(open_gguf_model, write_gguf(gguf_path, gguf_metadata(tiny.config, arch="qwen2"), tensors,
                                                      arch="qwen2"), "attn_q.bias", "missing")
    assert "blk.0" in message


def test_a_qwen3_q_norm_of_the_wrong_shape_is_named(gguf_path, tiny, tensors):
    head_dim = tiny.config.head_dim
    tensors.update({f"blk.{i}.attn_{p}_norm.weight": np.ones(head_dim, np.float32) for i in range(2) for p in "qk"})
    tensors["blk.1.attn_q_norm.weight"] = np.ones(head_dim + 2, np.float32)
    path = write_gguf(gguf_path, gguf_metadata(tiny.config, arch="qwen3"), tensors, arch="qwen3")
    assert_file_error(open_gguf_model, path, "blk.1.attn_q_norm.weight", f"shape [{head_dim + 2}], expected [{head_dim}]")


@pytest.mark.parametrize("option", ["attention_bias", "mlp_bias", "use_sliding_window"])
def test_config_options_kvlm_does_not_implement_are_refused(tmp_path, hf_config, hf_tensors, option):
    hf_config[option] = True
    with pytest.raises(UnsupportedModelError, match=f"{option}=True is not supported"):
        open_hf_folder(write_hf_folder(tmp_path, hf_config, hf_tensors))


def test_an_unknown_rope_type_is_named(tmp_path, hf_config, hf_tensors, gguf_path, metadata, tensors):
    hf_config.pop("rope_parameters", None)
    hf_config.update(rope_theta=10000.0, rope_scaling={"rope_type": "xpos", "factor": 2.0})
    folder = write_hf_folder(tmp_path, hf_config, hf_tensors)
    with pytest.raises(UnsupportedModelError, match=f"{folder / 'config.json'}: .*'xpos'"):
        open_hf_folder(folder)
    metadata["llama.rope.scaling.type"] = "xpos"
    with pytest.raises(UnsupportedModelError, match=f"{gguf_path}: .*'xpos'"):
        open_gguf_model(write_gguf(gguf_path, metadata, tensors))


def test_rope_scaling_that_is_not_an_object_is_named(tmp_path, hf_config, hf_tensors):
    hf_config.pop("rope_parameters", None)
    hf_config.update(rope_theta=10000.0, rope_scaling="linear")
    assert_file_error(open_hf_folder, write_hf_folder(tmp_path, hf_config, hf_tensors), "rope_scaling", "'linear'")


def test_a_qwen3_config_without_head_dim_gets_transformers_default(tmp_path):
    from kvlm.loader.hf_folder import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}))
    assert config_from_hf(tmp_path).head_dim == 128  # Qwen3Config's default, not 64 / 4


def test_bad_compute_settings_fail_before_the_model_is_looked_up():
    for settings, message in [({"quant": "int3"}, "quant must be one of"),
                              ({"dtype": "float16"}, "dtype must be one of")]:
        with pytest.raises(ValueError, match=message):
            load_model("no-such-model", **settings)  # a lookup would raise ModelFetchError instead


def test_partial_rotary_embeddings_of_llama_files_are_refused(gguf_path, metadata, tensors):
    metadata["llama.rope.dimension_count"] = 8
    with pytest.raises(UnsupportedModelError, match="dimension_count=8 rotates part of each 16-dim head"):
        read_gguf_config(write_gguf(gguf_path, metadata, tensors))


def test_model_config_checks_the_number_of_rope_frequency_factors():
    from kvlm.core.rope import RopeScaling

    with pytest.raises(ValueError, match="3 frequency factors; head_dim 16 needs 8"):
        replace(VALID, rope=RopeScaling(freq_factors=(1.0, 2.0, 4.0)))


def test_model_config_layer_kinds_are_checked():
    assert VALID.layer_kinds == ("attention", "attention")
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        replace(VALID, layer_kinds=("attention",) * 3)
    with pytest.raises(ValueError, match=r"unknown kinds \['rwkv'\]"):
        replace(VALID, layer_kinds=("attention", "rwkv"))
    with pytest.raises(ValueError, match="conv_kernel must be an integer >= 2 for mamba layers, got 0"):
        replace(VALID, layer_kinds=("attention", "mamba"))
