"""Phi-3 and Phi-4-mini (`phi3`): a Llama whose files store Q, K and V as one matrix (qkv_proj, GGUF's attn_qkv)
and the MLP's gate and up as one (gate_up_proj, GGUF's ffn_up, gate first); RoPE over the first
partial_rotary_factor of each head (Phi-4-mini's three quarters) with LongRoPE's short and long factors (see
kvlm.core.rope); Phi-3-mini's every layer attends over a sliding window (Phi-4-mini's window is longer than its
context: none). Neither llama.cpp's converter nor transformers permutes Q/K rows."""
from __future__ import annotations

from kvlm.core.family import SLIDING, Family


def _window(window, n_layer: int, n_ctx_train: int) -> dict:
    """Every layer sliding over `window` positions, where the window is shorter than the trained context."""
    if not window or window >= n_ctx_train:
        return {}
    return {"sliding_window": int(window), "layer_kinds": (SLIDING,) * n_layer}


def hf_options(raw: dict) -> dict:
    return _window(raw.get("sliding_window"), raw["num_hidden_layers"], raw.get("max_position_embeddings", 4096))


def gguf_options(key, tensor_names: frozenset[str]) -> dict:
    return _window(key("attention.sliding_window", 0), int(key("block_count")), int(key("context_length")))


FAMILY = Family(
    name="phi3", hf_architectures=("Phi3ForCausalLM",), hf_model_type="phi3",
    hf_layer_names=(("self_attn.qkv_proj", "attn_qkv"), ("mlp.gate_up_proj", "ffn_up")),
    fused_tensors=(("attn_qkv.weight", ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
                   ("ffn_up.weight", ("ffn_gate.weight", "ffn_up.weight"))),
    hf_options=hf_options, gguf_options=gguf_options,
)

FAMILIES = (FAMILY,)
