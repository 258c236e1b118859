"""Granite MoE (IBM's granite-3.x-1b-a400m and 3b-a800m; with a shared expert, GraniteMoeShared): Llama's attention
and experts (softmax over the top k's logits: renormalised), and Granite's multipliers: embeddings times one,
attention scores scaled by another (in place of 1/sqrt(head_dim)), each layer output times a third before its
residual add, logits divided by a fourth."""
from __future__ import annotations

from kvlm.core.family import Family


def hf_options(raw: dict) -> dict:
    """The multipliers from config.json; its attention scale replaces 1/sqrt(head_dim), so Q is multiplied by it
    times that root."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return {"embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
            "logit_scale": float(raw.get("logits_scaling", 1.0)),
            "query_scale": float(raw.get("attention_multiplier", head_dim ** -0.5)) * head_dim ** 0.5}


def gguf_options(key, tensor_names: frozenset[str]) -> dict:
    """The multipliers as llama.cpp reads them (attention.scale replaces 1/sqrt(head_dim); 0 or absent: that)."""
    head_dim = int(key("attention.key_length", int(key("embedding_length")) // int(key("attention.head_count"))))
    attention = float(key("attention.scale", 0.0) or head_dim ** -0.5)
    return {"embedding_multiplier": float(key("embedding_scale", 0.0) or 1.0),
            "residual_multiplier": float(key("residual_scale", 0.0) or 1.0),
            "logit_scale": float(key("logit_scale", 0.0) or 1.0), "query_scale": attention * head_dim ** 0.5}


FAMILY = Family(name="granitemoe", hf_architectures=("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
                hf_model_type="granitemoe", hf_other_model_types=("granitemoeshared",), gguf_expert_weights_norm=True,
                hf_expert_weights_norm=True, hf_options=hf_options, gguf_options=gguf_options,
                hf_layer_names=(("block_sparse_moe.router.layer", "ffn_gate_inp"),
                                ("block_sparse_moe.output_linear", "ffn_down_exps"),
                                ("shared_mlp.output_linear", "ffn_down_shexp")))

FAMILIES = (FAMILY,)
