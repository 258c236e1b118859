"""Gemma 4 (text): Gemma 3's layout (QK-norm, norms before and after attention and MLP, GeGLU, scaled embeddings,
sliding-window layers between full ones) with these of its own:
- full layers have their own head size and KV heads (global_head_dim, num_global_key_value_heads) and a
  "proportional" RoPE: the whole head's pairs (i, i + d/2), only the first partial_rotary_factor of the frequencies
  turning (the others 0), which llama.cpp writes as frequency factors of 1e30;
- attention scores are not scaled (scale 1: QK-norm bounds them), and V heads go through a weightless RMSNorm;
- full layers may take V from their K projection (attention_k_eq_v: no V projection, V = the K rows before K's norm);
- the last num_kv_shared_layers layers compute no K/V: each reads those of the last earlier layer of its kind;
- with use_double_wide_mlp those shared layers have an MLP twice as wide;
- per-layer inputs (PLE): a second embedding table gives every layer a small vector per token, mixed with a
  projection of the token's embedding; each layer adds proj(gelu(inp_gate(x)) * its vector), normed;
- each layer's output is multiplied by a learned scalar;
- optional experts beside the MLP (the 26B-A4B), routed from the residual stream;
- norms hold their multiplier (no 1 + w), in folders and GGUF files alike.
"""
from __future__ import annotations

from kvlm.core.errors import UnsupportedModelError
from kvlm.core.family import ATTENTION, SLIDING, Family
from kvlm.core.rope import RopeScaling, rope_from_hf_config

_HF_KINDS = {"full_attention": ATTENTION, "sliding_attention": SLIDING}
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}
_DEFAULT_GLOBAL_HEAD_DIM = 512  # transformers' default when config.json does not say
# llama.cpp's frequency factor for a pair that does not turn: its frequency divided by 1e30 is 0 for any position
_STILL = 1e30


def proportional_freq_factors(head_dim: int, partial_rotary_factor: float) -> tuple[float, ...]:
    """transformers' "proportional" RoPE as frequency factors over the whole head: the first
    int(partial x head_dim / 2) frequencies as the default RoPE of head_dim makes them, the others still."""
    turning = int(partial_rotary_factor * head_dim // 2)
    return (1.0,) * turning + (_STILL,) * (head_dim // 2 - turning)


def _layer_kinds(raw: dict) -> tuple[str, ...]:
    """transformers' layer types: config.json's, else five sliding layers per full one; the last always full."""
    n_layer = raw["num_hidden_layers"]
    types = list(raw.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                             for i in range(n_layer)])
    unknown = sorted(set(types) - _HF_KINDS.keys())
    if unknown:
        raise UnsupportedModelError(f"layer types {unknown} are not supported (supported: {', '.join(_HF_KINDS)})")
    types[-1] = "full_attention"
    return tuple(_HF_KINDS[kind] for kind in types)


def _full_geometry(raw: dict, kinds: tuple[str, ...]) -> tuple[int, int]:
    """(head size, KV heads) of the full layers: from per_layer_config (what transformers 5 writes back) or from
    global_head_dim / num_global_key_value_heads (the hub's config.json), the KV heads only with attention_k_eq_v."""
    per_layer = raw.get("per_layer_config")
    if per_layer:
        overrides = {int(layer): dict(values) for layer, values in per_layer.items()}
        full = {i for i, kind in enumerate(kinds) if kind == ATTENTION}
        distinct = {tuple(sorted(values.items())) for values in overrides.values()}
        if set(overrides) != full or len(distinct) != 1 or set(overrides[min(full)]) - {"head_dim", "num_key_value_heads"}:
            raise UnsupportedModelError(f"per_layer_config {per_layer!r} is not supported: only one head_dim and "
                                        f"num_key_value_heads for all full-attention layers")
        values = overrides[min(full)]
        return values.get("head_dim", raw["head_dim"]), values.get("num_key_value_heads", raw["num_key_value_heads"])
    global_kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v", True) else None
    return raw.get("global_head_dim", _DEFAULT_GLOBAL_HEAD_DIM), global_kv or raw["num_key_value_heads"]


def _hf_rope(params: dict, raw: dict, head_dim: int) -> RopeScaling:
    """One kind's RoPE: "proportional" as frequency factors over the whole head; transformers' default RoPE for
    Gemma 4 turns the whole head whatever partial_rotary_factor says."""
    if params.get("rope_type") != "proportional":
        return rope_from_hf_config({**raw, "rope_parameters": {k: v for k, v in params.items()
                                                                if k != "partial_rotary_factor"}, "rope_scaling": None})
    if params.get("factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"proportional RoPE with factor {params['factor']} is not supported")
    return RopeScaling(theta=float(params["rope_theta"]),
                       freq_factors=proportional_freq_factors(head_dim, params.get("partial_rotary_factor", 1.0)))


def hf_config(raw: dict) -> dict:
    """Gemma4TextConfig as ModelConfig fields."""
    activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"hidden activation {activation!r} is not supported for gemma4 models")
    vocab_per_layer = raw.get("vocab_size_per_layer_input", raw["vocab_size"])
    if raw.get("hidden_size_per_layer_input") and vocab_per_layer != raw["vocab_size"]:
        raise UnsupportedModelError(f"vocab_size_per_layer_input={vocab_per_layer} differs from vocab_size "
                                    f"({raw['vocab_size']}): not supported")
    kinds = _layer_kinds(raw)
    full_dim, full_kv = _full_geometry(raw, kinds)
    rope_params = raw.get("rope_parameters") or _DEFAULT_ROPE
    n_layer, n_ff, n_shared = raw["num_hidden_layers"], raw["intermediate_size"], raw.get("num_kv_shared_layers") or 0
    return {"n_ff": n_ff, "n_head": raw["num_attention_heads"], "n_head_kv": raw["num_key_value_heads"],
            "head_dim": raw["head_dim"], "full_head_dim": full_dim, "full_n_head_kv": full_kv,
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)), "layer_kinds": kinds,
            "sliding_window": raw.get("sliding_window") or 0,
            "rope": _hf_rope(rope_params["full_attention"], raw, full_dim),
            "rope_local": _hf_rope(rope_params["sliding_attention"], raw, raw["head_dim"]),
            "final_logit_softcap": float(raw.get("final_logit_softcapping") or 0.0), "n_kv_shared": n_shared,
            "full_v_is_k": bool(raw.get("attention_k_eq_v", False)),
            "per_layer_embd": raw.get("hidden_size_per_layer_input") or 0,
            "layer_n_ff": tuple(n_ff * 2 if i >= n_layer - n_shared else n_ff for i in range(n_layer))
            if raw.get("use_double_wide_mlp") else (),
            **_hf_experts(raw)}


def _hf_experts(raw: dict) -> dict:
    if not raw.get("enable_moe_block"):
        return {}
    return {"n_expert": raw["num_experts"], "n_expert_used": raw["top_k_experts"],
            "n_ff_exp": raw["moe_intermediate_size"], "expert_weights_norm": True}


def gguf_config(key, tensor_names: frozenset[str]) -> dict:
    """llama.cpp's gemma4 keys: key_length(_swa) and head_count_kv (per layer) give each kind's geometry,
    sliding_window_pattern the kinds, feed_forward_length (per layer with double-wide MLPs) the widths; a full
    layer without attn_v takes V from K (llama.cpp's rule for attention_k_eq_v files)."""
    n_layer = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layer:
        raise UnsupportedModelError(f"gemma4.attention.sliding_window_pattern={pattern!r}: one flag per layer expected")
    kinds = tuple(SLIDING if flag else ATTENTION for flag in pattern)
    kv_heads = _per_layer(key("attention.head_count_kv"), n_layer)
    n_ff = _per_layer(key("feed_forward_length", 0), n_layer)
    full, sliding = kinds.index(ATTENTION), kinds.index(SLIDING) if SLIDING in kinds else kinds.index(ATTENTION)
    head_dim, full_dim = int(key("attention.key_length_swa")), int(key("attention.key_length"))
    for name, dims, rotated in (("rope.dimension_count", full_dim, key("rope.dimension_count", full_dim)),
                                ("rope.dimension_count_swa", head_dim, key("rope.dimension_count_swa", head_dim))):
        if int(rotated) != dims:
            raise UnsupportedModelError(f"gemma4.{name}={rotated} rotates part of each {dims}-dim head: not supported")
    owners_without_v = [i for i, kind in enumerate(kinds) if kind == ATTENTION and f"blk.{i}.attn_k.weight" in tensor_names
                        and f"blk.{i}.attn_v.weight" not in tensor_names]
    return {"n_ff": n_ff[0], "layer_n_ff": tuple(n_ff) if len(set(n_ff)) > 1 else (),
            "n_head": int(key("attention.head_count")), "n_head_kv": kv_heads[sliding], "head_dim": head_dim,
            "full_head_dim": full_dim, "full_n_head_kv": kv_heads[full], "layer_kinds": kinds,
            "sliding_window": int(key("attention.sliding_window")),
            "rope_local": RopeScaling(theta=float(key("rope.freq_base_swa", 10_000.0))),
            "final_logit_softcap": float(key("final_logit_softcapping", 0.0)),
            "n_kv_shared": int(key("attention.shared_kv_layers", 0)), "full_v_is_k": bool(owners_without_v),
            "per_layer_embd": int(key("embedding_length_per_layer_input", 0)), **_gguf_experts(key, tensor_names, n_layer)}


def _gguf_experts(key, tensor_names: frozenset[str], n_layer: int) -> dict:
    """Experts where the file has a router (ffn_gate_inp), as llama.cpp reads them; their weights renormalised."""
    n_expert = int(key("expert_count", 0))
    if not n_expert:
        return {}
    return {"n_expert": n_expert, "n_expert_used": int(key("expert_used_count")),
            "n_ff_exp": int(key("expert_feed_forward_length")), "expert_weights_norm": True,
            "moe_layers": tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(n_layer))}


def _per_layer(value, n_layer: int) -> list[int]:
    """A key llama.cpp reads as one value or one per layer."""
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n_layer
    if len(values) != n_layer:
        raise UnsupportedModelError(f"a per-layer key has {len(values)} values for {n_layer} layers")
    return values


def expert_shapes(c) -> dict[str, tuple]:
    """What its experts have beside the MLP: the router's scale vector, the per-expert scale (stored as the experts'
    down projection's scale, as llama.cpp's converter names it) and their three norms."""
    n_embd = c.n_embd
    return {"ffn_gate_inp.scale": (n_embd,), "ffn_down_exps.scale": (c.n_expert,), "pre_ffw_norm_2.weight": (n_embd,),
            "post_ffw_norm_1.weight": (n_embd,), "post_ffw_norm_2.weight": (n_embd,)}


FAMILY = Family(
    name="gemma4", hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    hf_model_type="gemma4_text", hf_other_model_types=("gemma4",), qk_norm=True, sandwich_norms=True,
    activation="gelu_tanh", scaled_embedding=True,
    unscaled_attention=True, value_norm=True, layer_output_scale=True, experts_beside_mlp=expert_shapes, tensor_parallel=False,
    hf_layer_names=(("post_attention_layernorm", "post_attention_norm"), ("pre_feedforward_layernorm", "ffn_norm"),
                    ("post_feedforward_layernorm", "post_ffw_norm"), ("pre_feedforward_layernorm_2", "pre_ffw_norm_2"),
                    ("post_feedforward_layernorm_1", "post_ffw_norm_1"),
                    ("post_feedforward_layernorm_2", "post_ffw_norm_2"), ("router.proj", "ffn_gate_inp"),
                    ("router.scale", "ffn_gate_inp.scale"), ("router.per_expert_scale", "ffn_down_exps.scale"),
                    ("layer_scalar", "layer_output_scale.weight"), ("per_layer_input_gate", "inp_gate"),
                    ("per_layer_projection", "proj"), ("post_per_layer_input_norm", "post_norm")),
    hf_global_names=(("model.embed_tokens_per_layer", "per_layer_token_embd"),
                     ("model.per_layer_model_projection", "per_layer_model_proj"),
                     ("model.per_layer_projection_norm", "per_layer_proj_norm")),
    hf_config=hf_config, gguf_config=gguf_config,
)

FAMILIES = (FAMILY,)
