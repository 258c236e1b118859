"""Tiny random models of every family kvlm supports, with scaled RoPE, in all three file spellings.

Each model is built by transformers itself (random weights, never hub weights) and written as
- "hf-new": a Hugging Face folder as transformers 5 saves it (config.json with `rope_parameters`);
- "hf-old": the same folder in the older spelling (`rope_theta` + `rope_scaling`, as 4.x configs and most
  checkpoints on the hub still have it);
- "gguf": a GGUF file with the keys and tensors llama.cpp's convert_hf_to_gguf.py writes for the
  architecture (Q/K rows permuted for `llama` only; Llama 3 scaling as a `rope_freqs.weight` tensor).

The GGUF writing and the tokenizer are gguf_factory's; this module only adds what other families and RoPE
scalings need.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import Keys
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from helpers.gguf_factory import BOS_ID, EOS_ID, gguf_metadata, gguf_tensors, save_hf_folder, write_gguf
from kvlm.loader.hf_folder import gguf_name

SOURCES = ("hf-new", "hf-old", "gguf")
MAX_POSITIONS = 256
ORIGINAL_POSITIONS = 64  # small, so test prompts of ~120 tokens run well past it and the scaling matters


@dataclass(frozen=True)
class Spec:
    """One test model: its architecture, its config and how the older config.json spelled its RoPE."""

    arch: str  # GGUF general.architecture
    config_class: type
    model_class: type
    options: dict[str, Any]
    # The `rope_scaling` of the older spelling; "type" or "rope_type" as its key, or None for no scaling.
    old_rope_scaling: dict[str, Any] | None = None
    tokenizer_pre: str = "gpt2"
    seed: int = 0
    rope: dict[str, Any] = field(default_factory=dict)  # rope_parameters beyond rope_type/rope_theta


# head_dim 32 at least: the q8_0 cache quantizes K/V rows in blocks of 32.
_LLAMA = dict(vocab_size=1000, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
_QWEN3 = dict(vocab_size=1000, hidden_size=128, head_dim=64, intermediate_size=192, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)  # head_dim 64 != 128 / 4
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=ORIGINAL_POSITIONS)
_LINEAR_ROPE = dict(rope_type="linear", factor=4.0)
# Phi-4-mini's RoPE: three quarters of each 32-wide head (12 frequencies), short and long factors far apart
_LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL_POSITIONS, partial_rotary_factor=0.75,
                 short_factor=[1.0 + 0.05 * i for i in range(12)], long_factor=[1.0 + 0.8 * i for i in range(12)])
# beta_fast/beta_slow away from their defaults (32/1), so a loader that ignores them is caught.
_YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL_POSITIONS,
                  beta_fast=24.0, beta_slow=2.0)


def _renamed(rope: dict[str, Any], key: str) -> dict[str, Any]:
    """The rope parameters as an old `rope_scaling`, the type under `key` ("type" or "rope_type")."""
    old = {k: v for k, v in rope.items() if k != "rope_type"}
    return {key: rope["rope_type"], **old}


SPECS: dict[str, Spec] = {
    "llama-llama3": Spec("llama", LlamaConfig, LlamaForCausalLM,
                         dict(_LLAMA, rope_theta=500000.0, tie_word_embeddings=True), rope=_LLAMA3_ROPE,
                         old_rope_scaling=_renamed(_LLAMA3_ROPE, "rope_type"), tokenizer_pre="llama-bpe", seed=1),
    "llama-linear": Spec("llama", LlamaConfig, LlamaForCausalLM,
                         dict(_LLAMA, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3,
                              rope_theta=10000.0, tie_word_embeddings=False),
                         rope=_LINEAR_ROPE, old_rope_scaling=_renamed(_LINEAR_ROPE, "type"), seed=2),
    "qwen2": Spec("qwen2", Qwen2Config, Qwen2ForCausalLM,
                  dict(_LLAMA, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
                  tokenizer_pre="qwen2", seed=3),
    "qwen3": Spec("qwen3", Qwen3Config, Qwen3ForCausalLM,
                  dict(_QWEN3, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
                  tokenizer_pre="qwen2", seed=4),
    "qwen3-yarn": Spec("qwen3", Qwen3Config, Qwen3ForCausalLM,
                       dict(_QWEN3, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
                       rope=_YARN_ROPE, old_rope_scaling=_renamed(_YARN_ROPE, "type"), tokenizer_pre="qwen2",
                       seed=5),
    # four layers, so that the last attends without RoPE (transformers' default no_rope_layer_interval, llama.cpp's)
    "smollm3": Spec("smollm3", SmolLM3Config, SmolLM3ForCausalLM,
                    dict(_LLAMA, num_hidden_layers=4, rope_theta=2000000.0, tie_word_embeddings=True, pad_token_id=EOS_ID),
                    tokenizer_pre="llama-bpe", seed=6),
    # Q/K/V and gate/up stored fused; LongRoPE over a partial head; the original context at the top level too
    "phi3-longrope": Spec("phi3", Phi3Config, Phi3ForCausalLM,
                          dict(_LLAMA, rope_theta=10000.0, tie_word_embeddings=True, pad_token_id=EOS_ID,
                               original_max_position_embeddings=ORIGINAL_POSITIONS),
                          rope=_LONGROPE, old_rope_scaling=_renamed(_LONGROPE, "type"), seed=7),
    # Phi-3-mini's shape: every layer over a sliding window (short here, so that test prompts run past it)
    "phi3-window": Spec("phi3", Phi3Config, Phi3ForCausalLM,
                        dict(_LLAMA, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=EOS_ID,
                             sliding_window=48, original_max_position_embeddings=MAX_POSITIONS), seed=8),
}
# Architectures whose llama.cpp converter is Llama's: Q/K rows permuted for its RoPE
PERMUTED_QK = ("llama", "smollm3")


def make_config(spec: Spec):
    options = dict(spec.options)
    rope_parameters = {"rope_type": "default", "rope_theta": options.pop("rope_theta"), **spec.rope}
    return spec.config_class(
        **options,
        rope_parameters=rope_parameters,
        max_position_embeddings=MAX_POSITIONS,
        # Far above the default 0.02 (as gguf_factory.llama_config): a mistake moves logits past the tolerance.
        initializer_range=0.15,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def random_model(spec: Spec) -> PreTrainedModel:
    """The transformers model with every weight random and nonzero: norms in [0.5, 1.5] (QK-norms too),
    and Q/K/V biases, which transformers initialises to zero, drawn like the weights."""
    torch.manual_seed(spec.seed)
    model = spec.model_class(make_config(spec)).eval()
    return randomized_norms_and_biases(model)


def randomized_norms_and_biases(model: PreTrainedModel) -> PreTrainedModel:
    """Norms drawn in [0.5, 1.5] and biases like weights (transformers starts them at one and zero), so that a norm
    or bias read from the wrong tensor shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model


# --- Hugging Face folders ---

def save_hf_new(model: PreTrainedModel, folder: Path) -> Path:
    return save_hf_folder(model, folder)


def save_hf_old(model: PreTrainedModel, spec: Spec, folder: Path) -> Path:
    """The same folder with config.json in the pre-5 spelling: top-level `rope_theta`, `rope_scaling`."""
    save_hf_folder(model, folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope_parameters = config.pop("rope_parameters")
    config["rope_theta"] = rope_parameters["rope_theta"]
    config["rope_scaling"] = spec.old_rope_scaling
    path.write_text(json.dumps(config, indent=2))
    return folder


# --- GGUF, as llama.cpp's converter writes it ---

def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """`rope_freqs.weight` as LlamaModel.generate_extra_tensors computes it (conversion/llama.py):
    the divisor of each frequency. (The converter reads original_max_position_embeddings from the top
    level of the config and defaults to 8192, right for every real Llama 3.x; here the rope
    parameters' own value is used, as transformers does.)"""
    base, factor = rope["rope_theta"], rope.get("factor", 8.0)
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def rope_scaling_metadata(rope: dict[str, Any], arch: str) -> dict[str, Any]:
    """The `{arch}.rope.scaling.*` keys TextModel.set_gguf_parameters writes (conversion/base.py)."""
    key = {name: getattr(Keys.Rope, name).format(arch=arch) for name in dir(Keys.Rope) if name.isupper()}
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        return {key["SCALING_TYPE"]: "linear", key["SCALING_FACTOR"]: float(factor)}
    if kind == "yarn" and factor is not None:
        metadata = {key["SCALING_TYPE"]: "yarn", key["SCALING_FACTOR"]: float(factor),
                    key["SCALING_ORIG_CTX_LEN"]: int(rope["original_max_position_embeddings"])}
        optional = {"extrapolation_factor": "SCALING_YARN_EXT_FACTOR", "attention_factor": "SCALING_YARN_ATTN_FACTOR",
                    "beta_fast": "SCALING_YARN_BETA_FAST", "beta_slow": "SCALING_YARN_BETA_SLOW"}
        metadata.update({key[k]: float(rope[name]) for name, k in optional.items() if rope.get(name) is not None})
        return metadata
    return {}  # default; llama3 is a tensor, not keys


def family_gguf_metadata(model: PreTrainedModel, spec: Spec) -> dict[str, Any]:
    config = copy.deepcopy(model.config)
    config.head_dim = head_dim_of(config)  # Qwen2Config has none; gguf_metadata reads it
    metadata = gguf_metadata(config, spec.arch)
    metadata["general.name"] = f"tiny-random-{spec.arch}"
    metadata["tokenizer.ggml.pre"] = spec.tokenizer_pre
    metadata.update(rope_scaling_metadata(config.rope_parameters, spec.arch))
    if spec.arch == "phi3":
        metadata.update(phi3_metadata(config))
    return metadata


def phi3_metadata(config) -> dict[str, Any]:
    """What Phi3MiniModel.set_gguf_parameters and generate_extra_tensors write beside the common keys: the rotated
    dimensions, the original context, no window, and for LongRoPE the cos/sin magnitude."""
    rope, key = config.rope_parameters, lambda name: f"phi3.{name}"
    original = rope.get("original_max_position_embeddings", config.original_max_position_embeddings)
    metadata = {key("rope.dimension_count"): int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
                // config.num_attention_heads,
                key("rope.scaling.original_context_length"): int(original),
                key("attention.sliding_window"): int(config.sliding_window or 0)}
    if rope.get("long_factor"):
        scale = config.max_position_embeddings / original
        metadata[key("rope.scaling.attn_factor")] = math.sqrt(1 + math.log(scale) / math.log(original))
    return metadata


# llama.cpp's tensor map for Phi-3's fused matrices
_PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def phi3_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """Phi-3's weights as its converter names them (Q/K/V and gate/up as stored), LongRoPE's factors as tensors."""
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        parts = name.split(".")
        fused = _PHI3_NAMES.get(".".join(parts[3:-1])) if name.startswith("model.layers.") else None
        tensors[f"blk.{parts[2]}.{fused}.weight" if fused else gguf_name(name)] = value.float().numpy().copy()
    rope = model.config.rope_parameters
    if rope.get("long_factor"):
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return tensors


def family_gguf_tensors(model: PreTrainedModel, spec: Spec) -> dict[str, np.ndarray]:
    """GGUF-named weights; Q/K rows permuted only for Llama's converter (llama.cpp's LlamaModel.undo_permute;
    Qwen2Model/Qwen3Model keep the Hugging Face layout)."""
    config = model.config
    if spec.arch == "phi3":
        return phi3_tensors(model)
    if spec.arch in PERMUTED_QK:
        tensors = gguf_tensors(model)
    else:
        tensors = {gguf_name(name): value.float().numpy().copy() for name, value in model.state_dict().items()
                   if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    if config.rope_parameters.get("rope_type") == "llama3":
        tensors = {"rope_freqs.weight": llama3_rope_factors(config.rope_parameters, head_dim_of(config)), **tensors}
    return tensors


def write_family_gguf(model: PreTrainedModel, spec: Spec, path: Path) -> Path:
    return write_gguf(path, family_gguf_metadata(model, spec), family_gguf_tensors(model, spec), arch=spec.arch)


def save_model(model: PreTrainedModel, spec: Spec, source: str, folder: Path) -> Path:
    """The model written as `source` into the empty `folder`: the folder, or the .gguf file in it."""
    if source == "hf-new":
        return save_hf_new(model, folder)
    if source == "hf-old":
        return save_hf_old(model, spec, folder)
    if source == "gguf":
        return write_family_gguf(model, spec, folder / "model.gguf")
    raise ValueError(f"unknown source {source!r} (known: {', '.join(SOURCES)})")
