"""Loading a Hugging Face model folder: config.json plus *.safetensors, renamed to GGUF names."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvlm.errors import ModelFileError
from kvlm.loader.config import ModelConfig
from kvlm.model.rope import RopeScaling
from kvlm.loader.weights import ModelWeights, expected_shapes

SUPPORTED_MODEL_TYPES = ("llama",)

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_HF_LAYER_NAMES = {gguf: hf for hf, gguf in _LAYER_NAMES.items()}
_HF_GLOBAL_NAMES = {gguf: hf for hf, gguf in _GLOBAL_NAMES.items()}


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, ModelWeights]:
    folder = Path(folder)
    config = config_from_hf(folder)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, value in _read_safetensors(file).items():
            tensors[gguf_name(name)] = value.float()
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name == "output.weight" and config.tie_word_embeddings:
            continue
        weights[name] = _checked(folder, tensors, name, shape)
    return config, ModelWeights(config, weights)


def config_from_hf(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: cannot read the model config ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelFileError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        n_head = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        return ModelConfig(
            architecture=model_type,
            name=raw.get("_name_or_path") or folder.name,
            n_layer=raw["num_hidden_layers"],
            n_embd=raw["hidden_size"],
            n_ff=raw["intermediate_size"],
            n_head=n_head,
            n_head_kv=raw.get("num_key_value_heads") or n_head,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // max(n_head, 1),
            vocab_size=raw["vocab_size"],
            n_ctx_train=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=RopeScaling(theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))),
        )
    except KeyError as exc:
        raise ModelFileError(f"{path}: the config has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:  # values of the wrong type, or ones ModelConfig rejects
        raise ModelFileError(f"{path}: the config describes an invalid model: {exc}") from exc


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{kind}"
    return hf_name


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor name: what errors about a folder should say."""
    stem, _, kind = name.rpartition(".")
    if stem in _HF_GLOBAL_NAMES:
        return f"{_HF_GLOBAL_NAMES[stem]}.{kind}"
    parts = stem.split(".")  # blk, N, part
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _HF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_HF_LAYER_NAMES[parts[2]]}.{kind}"
    return name


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{file}: not a readable safetensors file ({exc})") from exc


def _checked(folder: Path, tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise ModelFileError(f"{folder}: tensor {hf_name(name)} is missing (expected shape {list(shape)})")
    if tuple(tensor.shape) != shape:
        raise ModelFileError(
            f"{folder}: tensor {hf_name(name)} has shape {list(tensor.shape)}, expected {list(shape)}"
        )
    return tensor
