"""Tiny random mixture-of-experts models of every MoE family kvlm reads, made by transformers (never hub weights),
as a Hugging Face folder (what save_pretrained writes: one tensor per expert) and as a GGUF file written as
llama.cpp's convert_hf_to_gguf.py writes it: the saved tensors with each layer's experts stacked into one
[expert, rows, cols] tensor, named by the gguf package's own tensor-name map, Granite's stacked gate/up split in
two, Q/K rows permuted for the `llama` architecture (Mixtral), and the converter's metadata keys."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open
from transformers import (
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    GraniteMoeSharedConfig,
    GraniteMoeSharedForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from helpers.family_factory import Spec, randomized_norms_and_biases
from helpers.gguf_factory import BOS_ID, EOS_ID, gguf_metadata, permute_rope_rows, save_hf_folder, write_gguf

_BASE = dict(vocab_size=1000, hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15, bos_token_id=BOS_ID,
             eos_token_id=EOS_ID, tie_word_embeddings=False)


@dataclass(frozen=True)
class MoESpec(Spec):
    gguf_keys: dict[str, Any] = field(default_factory=dict)  # metadata the converter writes beyond the common keys


SPECS: dict[str, MoESpec] = {
    # The released 30B-A3B's routing (renormalised), QK-norm, head_dim apart from hidden / heads.
    "qwen3moe": MoESpec("qwen3moe", Qwen3MoeConfig, Qwen3MoeForCausalLM,
                        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, head_dim=32,
                             norm_topk_prob=True, rms_norm_eps=1e-6), seed=11),
    # transformers' default (not renormalised), a plain MLP in layer 1 (mlp_only_layers).
    "qwen3moe-dense-layer": MoESpec("qwen3moe", Qwen3MoeConfig, Qwen3MoeForCausalLM,
                                    dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                         norm_topk_prob=False, mlp_only_layers=[1]), seed=12,
                                    gguf_keys={"expert_weights_norm": False}),
    "olmoe": MoESpec("olmoe", OlmoeConfig, OlmoeForCausalLM, dict(num_experts=8, num_experts_per_tok=2), seed=13),
    "qwen2moe": MoESpec("qwen2moe", Qwen2MoeConfig, Qwen2MoeForCausalLM,
                        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64), seed=14),
    "mixtral": MoESpec("llama", MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2),
                       seed=15),
    "granitemoe": MoESpec("granitemoe", GraniteMoeConfig, GraniteMoeForCausalLM,
                          dict(num_local_experts=6, num_experts_per_tok=2, embedding_multiplier=3.0,
                               attention_multiplier=0.09, residual_multiplier=0.6, logits_scaling=2.5), seed=16),
    "granitemoeshared": MoESpec("granitemoe", GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM,
                                dict(num_local_experts=6, num_experts_per_tok=2, shared_intermediate_size=64,
                                     embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.7,
                                     logits_scaling=1.5), seed=17),
}


def random_moe(spec: MoESpec) -> PreTrainedModel:
    """The transformers model with random weights, norms in [0.5, 1.5] and biases drawn like weights."""
    torch.manual_seed(spec.seed)
    return randomized_norms_and_biases(spec.model_class(spec.config_class(**{**_BASE, **spec.options})).eval())


def save_moe_folder(model: PreTrainedModel, folder: Path) -> Path:
    return save_hf_folder(model, folder)


# --- GGUF, as llama.cpp's converter writes it ---

_PER_EXPERT = re.compile(r"(?P<stem>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight")
_SPLIT = {"block_sparse_moe.input_linear": (gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP),
          "shared_mlp.input_linear": (gguf.MODEL_TENSOR.FFN_GATE_SHEXP, gguf.MODEL_TENSOR.FFN_UP_SHEXP)}


def _saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({name: f.get_tensor(name).float() for name in f.keys()})
    return tensors


def moe_gguf_tensors(folder: Path, spec: MoESpec, config) -> dict[str, np.ndarray]:
    """The saved tensors under GGUF names: experts stacked, Granite's gate/up split, Q/K permuted for `llama`."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == spec.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    saved, stacked = _saved_tensors(folder), {}
    for name, value in saved.items():
        match = _PER_EXPERT.fullmatch(name)
        if match:  # the converter gathers experts.N.gate_proj into experts.gate_proj
            stacked.setdefault(f"{match['stem']}.{match['part']}", {})[int(match["expert"])] = value
    tensors = {}
    for stem, experts in stacked.items():
        tensors[names.get_name(stem) + ".weight"] = torch.stack([experts[e] for e in sorted(experts)]).numpy()
    for name, value in saved.items():
        if _PER_EXPERT.fullmatch(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        stem, _, kind = name.rpartition(".")
        split = next((parts for suffix, parts in _SPLIT.items() if stem.endswith(suffix)), None)
        if split is not None:
            layer = int(stem.split(".")[2])
            for part, half in zip(split, value.chunk(2, dim=-2)):
                tensors[gguf.TENSOR_NAMES[part].format(bid=layer) + f".{kind}"] = half.contiguous().numpy()
            continue
        # A plain MLP among experts (Qwen3-MoE's mlp_only_layers) is not in qwen3moe's map: Llama's names for it.
        target = names.get_name(stem) or gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers).get_name(stem)
        assert target is not None, f"the gguf tensor map has no name for {name}"
        array = value.numpy()
        if spec.arch == "llama" and target.endswith(("attn_q", "attn_k")):
            heads = config.num_attention_heads if target.endswith("attn_q") else config.num_key_value_heads
            array = permute_rope_rows(array, heads)
        tensors[f"{target}.{kind}"] = array
    return tensors


def moe_gguf_metadata(spec: MoESpec, config) -> dict[str, Any]:
    arch = spec.arch
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    metadata = gguf_metadata(config, arch)
    metadata["general.name"] = f"tiny-random-{arch}-moe"
    n_expert = getattr(config, "num_experts", None) or config.num_local_experts
    metadata.update({f"{arch}.expert_count": n_expert, f"{arch}.expert_used_count": config.num_experts_per_tok})
    if getattr(config, "moe_intermediate_size", None):
        metadata[f"{arch}.expert_feed_forward_length"] = config.moe_intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or getattr(config, "shared_intermediate_size", 0)
    if shared:
        metadata[f"{arch}.expert_shared_feed_forward_length"] = shared
    if arch == "granitemoe":
        metadata.update({f"{arch}.embedding_scale": float(config.embedding_multiplier),
                         f"{arch}.residual_scale": float(config.residual_multiplier),
                         f"{arch}.attention.scale": float(config.attention_multiplier),
                         f"{arch}.logit_scale": float(config.logits_scaling)})
    metadata.update({f"{arch}.{key}": value for key, value in spec.gguf_keys.items()})
    return metadata


EXPERT_LAYOUTS = ("stacked", "per-expert", "fused")


def relaid_experts(tensors: dict[str, np.ndarray], layout: str) -> dict[str, np.ndarray]:
    """The experts as older files store them (one tensor per expert: blk.N.ffn_gate.E.weight, as llama.cpp's
    converter wrote Mixtral before it stacked experts) or as newer ones may (gate and up fused per expert:
    blk.N.ffn_gate_up_exps.weight)."""
    if layout == "stacked":
        return tensors
    out = {}
    for name, value in tensors.items():
        pieces = name.split(".")
        block, part = ".".join(pieces[:2]), pieces[2] if len(pieces) > 3 else ""
        if layout == "per-expert" and part.endswith("_exps"):
            out.update({f"{block}.{part[:-5]}.{e}.weight": value[e] for e in range(len(value))})
        elif layout == "fused" and part == "ffn_gate_exps":
            up = tensors[name.replace("ffn_gate_exps", "ffn_up_exps")]
            out[name.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate([value, up], axis=1)
        elif not (layout == "fused" and part == "ffn_up_exps"):
            out[name] = value
    return out


def write_moe_gguf(model: PreTrainedModel, spec: MoESpec, folder: Path, path: Path,
                   quant: GGMLQuantizationType = GGMLQuantizationType.F32, layout: str = "stacked") -> Path:
    """`folder`: the model saved by save_moe_folder (the converter reads the saved files); `layout`: how the file
    stores the experts (EXPERT_LAYOUTS)."""
    config = model.config
    tensors = relaid_experts(moe_gguf_tensors(folder, spec, config), layout)
    return write_gguf(path, moe_gguf_metadata(spec, config), tensors, arch=spec.arch,
                      quant=quant, keep_f32=("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
