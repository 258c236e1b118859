"""Gemma 3 (text): QK-norm, norms before and after attention and MLP, GeGLU, scaled embeddings, and five
sliding-window layers for every full one, whose RoPE has its own base."""
from kvlm.families.family import Family


def gguf_query_scale(n_layer: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """llama.cpp (LLM_ARCH_GEMMA3) scales scores by 1/sqrt(head_dim), except for the 27B (62 layers), whose
    query_pre_attn_scalar is n_embd / n_head: Q times sqrt(head_dim / that)."""
    return (head_dim / (n_embd // n_head)) ** 0.5 if n_layer == 62 else 1.0


FAMILY = Family(
    name="gemma3", hf_architectures=("Gemma3ForCausalLM",), hf_model_type="gemma3_text", qk_norm=True,
    default_head_dim=256, sandwich_norms=True, activation="gelu_tanh", scaled_embedding=True, hf_norm_offset=1.0,
    sliding_period=6,
    hf_layer_names=(("post_attention_layernorm", "post_attention_norm"), ("pre_feedforward_layernorm", "ffn_norm"),
                    ("post_feedforward_layernorm", "post_ffw_norm")),
    gguf_query_scale=gguf_query_scale,
)
