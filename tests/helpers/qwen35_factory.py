"""Tiny random Qwen3.5 models that transformers makes (never hub weights): the dense Qwen3_5ForCausalLM and the
Qwen3_5MoeForCausalLM, each 8 layers of 3 Gated DeltaNet (linear attention) layers then 1 gated full-attention layer,
twice. Written as a Hugging Face folder (what save_pretrained writes; the dense one also as the
Qwen3_5ForConditionalGeneration folder the hub releases hold, vision tower and MTP head included) and as a GGUF file
written as llama.cpp's converter writes one (conversion/qwen.py: Qwen3_5TextModel, arch "qwen35", and
Qwen3_5MoeTextModel, arch "qwen35moe", built on Qwen3NextModel and _LinearAttentionVReorderBase):
- names from the gguf package's own map; dt_bias renamed dt_proj.bias first (-> ssm_dt.bias);
- value heads reordered from grouped (by key head) to tiled, since linear_num_key_heads != linear_num_value_heads;
- A_log stored as A = -exp(A_log) (ssm_a), conv1d squeezed to [channels, kernel];
- every "norm.weight" but the gated norm's (linear_attn.norm) stored as 1 + w: GGUF holds the multiplier;
- the experts (transformers 5 holds them fused, gate_up_proj [E, 2 ff, d], gate the first half) split into
  ffn_gate_exps / ffn_up_exps;
- its metadata: ssm.*, full_attention_interval, rope.dimension_count (the rotated dims only), the mrope sections.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from helpers.gguf_factory import BOS_ID, EOS_ID, add_value, byte_level_tokenizer, gguf_metadata, save_hf_folder
from helpers.moe_factory import relaid_experts

F32 = GGMLQuantizationType.F32
FULL_ATTENTION_INTERVAL = 4
# transformers 5 writes rope_parameters so (partial_rotary_factor inside, not at the top level of the config): 8 of
# the 32 dims of a head rotated, as 4 frequencies; interleaved MRoPE gives frequency 1 the H position, 2 the W one,
# the rest T; for text all three are the token's position, so it is plain RoPE (NeoX halves) over the first 8 dims.
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
        "mrope_interleaved": True}
_TEXT = dict(vocab_size=1024, hidden_size=64, num_hidden_layers=8, full_attention_interval=FULL_ATTENTION_INTERVAL,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# Each small: enough to be a Qwen3_5ForConditionalGeneration, whose text part ignores them.
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)


# --- the transformers models ---

def random_qwen35(seed: int = 0, **overrides) -> Qwen3_5ForCausalLM:
    """transformers' dense Qwen3.5 (eval, float32, eager attention), weights drawn by `_randomize`."""
    rope = overrides.pop("rope_parameters", ROPE)
    config = Qwen3_5TextConfig(**{**_TEXT, "intermediate_size": 128, **overrides}, rope_parameters=copy.deepcopy(rope),
                               attn_implementation="eager")
    torch.manual_seed(seed)
    return _randomize(Qwen3_5ForCausalLM(config).eval())


def random_qwen35_moe(seed: int = 0, **overrides) -> Qwen3_5MoeForCausalLM:
    """transformers' Qwen3.5-MoE: 4 experts, 2 per token (renormalised softmax top-k), a shared expert behind a
    sigmoid gate; otherwise random_qwen35's shapes."""
    rope = overrides.pop("rope_parameters", ROPE)
    config = Qwen3_5MoeTextConfig(**{**_TEXT, **_MOE, **overrides}, rope_parameters=copy.deepcopy(rope),
                                  attn_implementation="eager")
    torch.manual_seed(seed)
    return _randomize(Qwen3_5MoeForCausalLM(config).eval())


def _randomize(model):
    """RMSNorms (forward x (1 + w)) in [-0.3, 0.3]; the gated norm (a plain multiplier) in [0.5, 1.5]; A_log and
    dt_bias in [-1, 1], so each token keeps ~10% to ~95% of the state (exp(-exp(A_log) softplus(a + dt_bias)));
    the router normal(0, 0.3), well spread (yet over hundreds of tokens a 2nd and 3rd expert may still come within
    1e-5 in probability); the embeddings normal(0, 0.1), the delta-rule layers' input projections normal(0, 0.025),
    every other matrix normal(0, 0.05). Larger weights make a random Qwen3.5 amplify rounding: with every matrix at
    0.1 and the convolution at 0.3, transformers' own float32 logits were 1.4e-4 from its float64 ones over 150
    tokens, and rounding its weights to Q8_0 moved its logits by 0.5 (at these scales: 0.07)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):
                param.uniform_(-0.3, 0.3)
            elif name.endswith(("A_log", "dt_bias")):
                param.uniform_(-1.0, 1.0)
            elif "linear_attn.in_proj" in name:
                param.normal_(0.0, 0.025)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
    return model


# --- Hugging Face folders ---

def save_qwen35_folder(model: Qwen3_5ForCausalLM, folder: Path) -> Path:
    """save_pretrained's folder (tensors model.layers.N..., config.json model_type "qwen3_5_text") with the
    byte-level tokenizer."""
    return save_hf_folder(model, folder)


def save_qwen35_moe_folder(model: Qwen3_5MoeForCausalLM, folder: Path) -> Path:
    """save_pretrained's folder: transformers 5 writes the experts back one tensor per expert
    (mlp.experts.E.gate_proj/up_proj/down_proj.weight), not as the fused gate_up_proj it holds."""
    return save_hf_folder(model, folder)


def qwen35_vl_model(model: Qwen3_5ForCausalLM, seed: int = 0) -> Qwen3_5ForConditionalGeneration:
    """A Qwen3_5ForConditionalGeneration holding `model`'s text weights and a tiny random vision tower."""
    text = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "transformers_version")}
    config = Qwen3_5Config(text_config=text, vision_config=dict(VISION), tie_word_embeddings=False)
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        vl = Qwen3_5ForConditionalGeneration(config).eval()
    vl.set_attn_implementation("eager")
    with torch.no_grad():
        vl.model.language_model.load_state_dict(model.model.state_dict())
        vl.lm_head.weight.copy_(model.lm_head.weight)
    return vl


def save_qwen35_vl_folder(model: Qwen3_5ForCausalLM, folder: Path) -> Path:
    """The same weights as the hub's Qwen3.5 folders hold them: architectures ["Qwen3_5ForConditionalGeneration"],
    model_type "qwen3_5", the text config under "text_config" (model_type "qwen3_5_text"), a small "vision_config";
    tensors model.language_model.*, lm_head.weight, model.visual.*, and an MTP head's tensors (mtp.fc.weight, and
    one under mtp.layers.0, named like a decoder layer's) that a text-only reader must ignore."""
    folder = Path(folder)
    qwen35_vl_model(model).save_pretrained(folder)
    byte_level_tokenizer(model.config.vocab_size).save_pretrained(folder)
    file = folder / "model.safetensors"
    with safe_open(file, "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    d = model.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    tensors["mtp.fc.weight"] = torch.randn(d, 2 * d, generator=generator) * 0.1
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.rand(d, generator=generator) - 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return folder


# --- GGUF, as llama.cpp's converter writes it ---

def _tiled(array: np.ndarray, axis: int, n_k: int, n_v: int, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: the axis's n_v * head_dim entries viewed as
    [n_k, n_v / n_k, head_dim], its first two axes swapped: value heads from grouped by key head (k0v0, k0v1, k1v0,
    k1v1) to tiled (k0v0, k1v0, k0v1, k1v1), which ggml's broadcast of the key heads expects."""
    shape = array.shape
    split = shape[:axis] + (n_k, n_v // n_k, head_dim) + shape[axis + 1:]
    return np.ascontiguousarray(array.reshape(split).swapaxes(axis, axis + 1)).reshape(shape)


def _reorder_v_heads(name: str, array: np.ndarray, config) -> np.ndarray:
    """What the converter reorders when linear_num_key_heads != linear_num_value_heads (on the HF names, first)."""
    n_k, n_v = config.linear_num_key_heads, config.linear_num_value_heads
    if n_k == n_v or "linear_attn." not in name:
        return array
    d_v, qk = config.linear_value_head_dim, 2 * n_k * config.linear_key_head_dim
    if ".in_proj_qkv." in name or ".conv1d." in name:  # the V rows / channels, after q and k
        return np.concatenate([array[:qk], _tiled(array[qk:], 0, n_k, n_v, d_v)])
    if ".in_proj_z." in name:
        return _tiled(array, 0, n_k, n_v, d_v)
    if ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
        return _tiled(array, 0, n_k, n_v, 1)
    if ".out_proj." in name:
        return _tiled(array, 1, n_k, n_v, d_v)
    return array


def qwen35_gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors as Qwen3_5TextModel / Qwen3_5MoeTextModel name and lay them out."""
    config = model.config
    arch = gguf.MODEL_ARCH.QWEN35MOE if hasattr(config, "num_experts") else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.startswith("mtp.") or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        array = _reorder_v_heads(name, value.float().numpy(), config)
        if name.endswith(".A_log"):
            array = -np.exp(array)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif ".conv1d." in name:
            array = array.squeeze(1)  # [channels, 1, kernel] -> [channels, kernel]
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            array = array + 1.0
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 ff, d]: gate rows first (chunk(2) of the output)
            gate, up = np.split(array, 2, axis=1)
            stem = name.removesuffix(".gate_up_proj")
            tensors[names.get_name(f"{stem}.gate_proj") + ".weight"] = np.ascontiguousarray(gate)
            tensors[names.get_name(f"{stem}.up_proj") + ".weight"] = np.ascontiguousarray(up)
            continue
        if name.endswith("mlp.experts.down_proj"):  # [E, d, ff]
            tensors[names.get_name(name) + ".weight"] = array
            continue
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key is not None, f"the gguf tensor map has no name for {name}"
        tensors[key] = array
    return tensors


def qwen35_gguf_metadata(model, arch: str = "qwen35") -> dict[str, Any]:
    """gguf_factory's keys (the converter's TextModel ones and the tokenizer's) and Qwen3NextModel's."""
    c = model.config
    rope = c.rope_parameters
    moe = hasattr(c, "num_experts")
    shim = SimpleNamespace(num_hidden_layers=c.num_hidden_layers, max_position_embeddings=c.max_position_embeddings,
                           hidden_size=c.hidden_size, intermediate_size=0 if moe else c.intermediate_size,
                           num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                           head_dim=c.head_dim, rope_parameters=rope, rms_norm_eps=c.rms_norm_eps,
                           vocab_size=c.vocab_size)
    metadata = gguf_metadata(shim, arch)
    metadata["general.name"] = f"tiny-random-{arch}"
    metadata["tokenizer.ggml.pre"] = "qwen35"  # what Qwen3.5's files carry (llama.cpp refuses gpt2's for qwen35)
    if moe:  # Qwen3_5MoeTextConfig has no intermediate_size: the converter writes no feed_forward_length
        del metadata[f"{arch}.feed_forward_length"]
        metadata.update({f"{arch}.expert_count": c.num_experts, f"{arch}.expert_used_count": c.num_experts_per_tok,
                         f"{arch}.expert_feed_forward_length": c.moe_intermediate_size,
                         f"{arch}.expert_shared_feed_forward_length": c.shared_expert_intermediate_size})
    sections = list(rope.get("mrope_section", [11, 11, 10]))  # _Qwen35MRopeMixin's default when absent
    metadata.update({
        f"{arch}.ssm.conv_kernel": c.linear_conv_kernel_dim,
        f"{arch}.ssm.state_size": c.linear_key_head_dim,
        f"{arch}.ssm.group_count": c.linear_num_key_heads,
        f"{arch}.ssm.time_step_rank": c.linear_num_value_heads,
        f"{arch}.ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
        # hparams.get("full_attention_interval", 4): save_pretrained writes layer_types, not the interval
        f"{arch}.full_attention_interval": getattr(c, "full_attention_interval", FULL_ATTENTION_INTERVAL),
        # the converter reads hparams.get("partial_rotary_factor", 0.25), absent from the top level of a
        # transformers 5 config.json (it is inside rope_parameters): 0.25 either way for these models
        f"{arch}.rope.dimension_count": int(c.head_dim * rope.get("partial_rotary_factor", 0.25)),
        f"{arch}.rope.dimension_sections": (sections + [0] * 4)[:4],
    })
    return metadata


# Matrices the converter keeps F32 whatever the file type (besides 1-D tensors, norms and names not ending in
# ".weight": ssm_a, ssm_dt.bias): its SSM_CONV1D, FFN_GATE_INP and FFN_GATE_INP_SHEXP.
KEEP_F32 = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "_norm.weight")


def _stored_type(name: str, array: np.ndarray, quant: GGMLQuantizationType) -> GGMLQuantizationType:
    if quant == F32 or array.ndim <= 1 or name.endswith(KEEP_F32) or not name.endswith(".weight"):
        return F32
    block = gguf.GGML_QUANT_SIZES[quant][0]
    if array.shape[-1] % block:  # gguf.QuantError in the converter: "falling back to F16"
        return GGMLQuantizationType.F16
    return quant


def _write_gguf(path: Path, metadata: dict[str, Any], tensors: dict[str, np.ndarray], arch: str,
                quant: GGMLQuantizationType) -> Path:
    """gguf_factory.write_gguf with the converter's rules for what stays F32 and its F16 fallback for a matrix
    whose rows do not fill whole blocks (Q8_0: the MoE's ffn_down_shexp, rows of 48)."""
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        add_value(writer, key, value)
    for name, array in tensors.items():
        kind = _stored_type(name, array, quant)
        if kind == F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(array, dtype=np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen35_gguf(model: Qwen3_5ForCausalLM, path: Path, quant: GGMLQuantizationType = F32) -> Path:
    """The dense model as llama.cpp's Qwen3_5TextModel writes it (arch "qwen35"). `quant`: the converter's
    --outtype (F32, F16, BF16, Q8_0): matrices in it, the rest F32 as the converter keeps them."""
    return _write_gguf(Path(path), qwen35_gguf_metadata(model, "qwen35"), qwen35_gguf_tensors(model), "qwen35", quant)


def write_qwen35moe_gguf(model: Qwen3_5MoeForCausalLM, path: Path, quant: GGMLQuantizationType = F32,
                         layout: str = "stacked") -> Path:
    """The MoE model as llama.cpp's Qwen3_5MoeTextModel writes it (arch "qwen35moe"): experts stacked
    [E, rows, cols] as ffn_gate_exps / ffn_up_exps / ffn_down_exps, router ffn_gate_inp and shared-expert gate
    ffn_gate_inp_shexp ([1, d]) in F32. `layout`: moe_factory's EXPERT_LAYOUTS ("fused": ffn_gate_up_exps, as the
    converter's --fuse-gate-up-exps writes)."""
    tensors = relaid_experts(qwen35_gguf_tensors(model), layout)
    return _write_gguf(Path(path), qwen35_gguf_metadata(model, "qwen35moe"), tensors, "qwen35moe", quant)


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], GGMLQuantizationType]]]:
    """A file's metadata (values decoded) and its tensors' shapes (PyTorch order) and types: for checks."""
    reader = gguf.GGUFReader(path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type) for t in reader.tensors}
    return metadata, tensors


def saved_config(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())
