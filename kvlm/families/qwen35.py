"""Qwen3.5 (dense 0.8B-27B, and the MoE models): three Gated DeltaNet layers (linear attention: a causal
convolution, then a delta-rule state per value head, decayed and corrected at every token; see
kvlm.model.recurrent) before every full-attention layer, which has QK-norm, an output gate (the Q projection gives
each head a gate beside its query: the output times sigmoid(gate)) and RoPE over a quarter of each head. Its norms are
stored as w - 1 in Hugging Face folders (the forward multiplies by 1 + w), except the delta-rule's gated norm.

Its text positions make the model's multimodal RoPE (sections of T, H, W positions) a plain RoPE: every section
reads the same position. The MoE models put experts on every layer, delta-rule layers included, with a shared
expert gated by sigmoid(w . x), the chosen experts' weights renormalised."""
import torch

from kvlm.core.family import Family

_LAYER_NAMES = (("linear_attn.in_proj_qkv", "attn_qkv"), ("linear_attn.in_proj_z", "attn_gate"),
                ("linear_attn.in_proj_b", "ssm_beta"), ("linear_attn.in_proj_a", "ssm_alpha"),
                ("linear_attn.conv1d", "ssm_conv1d"), ("linear_attn.A_log", "ssm_a"),
                ("linear_attn.dt_bias", "ssm_dt.bias"), ("linear_attn.norm", "ssm_norm"),
                ("linear_attn.out_proj", "ssm_out"))
_EXPERT_NAMES = (("mlp.gate", "ffn_gate_inp"), ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
                 ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"), ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
                 ("mlp.shared_expert.down_proj", "ffn_down_shexp"))


def gated_delta_shapes(c) -> dict[str, tuple]:
    """A Gated DeltaNet mixer's tensors in GGUF naming (llama.cpp's qwen35): the Q/K/V projection, the output
    gate's (attn_gate), beta's and the decay's (ssm_beta, ssm_alpha), the convolution, A (= -exp(A_log)), the
    time-step bias, the gated norm (over one value head) and the output projection."""
    n_embd, k_dim, v_heads = c.n_embd, c.ssm_groups * c.ssm_state, c.ssm_heads
    conv_dim = 2 * k_dim + c.ssm_inner
    return {"attn_qkv.weight": (conv_dim, n_embd), "attn_gate.weight": (c.ssm_inner, n_embd),
            "ssm_beta.weight": (v_heads, n_embd), "ssm_alpha.weight": (v_heads, n_embd),
            "ssm_conv1d.weight": (conv_dim, c.conv_kernel), "ssm_a": (v_heads,), "ssm_dt.bias": (v_heads,),
            "ssm_norm.weight": (c.ssm_inner // v_heads,), "ssm_out.weight": (n_embd, c.ssm_inner)}


# GGUF stores A itself (-exp(A_log)), as llama.cpp's converter writes it; its pre-MLP norm is post_attention_norm
_COMMON = dict(qk_norm=True, attention_output_gate=True, hf_norm_offset=1.0, default_head_dim=256,
               recurrent_shapes=gated_delta_shapes,
               hf_values=(("ssm_a", lambda a_log: -torch.exp(a_log)),),
               gguf_layer_names=(("ffn_norm", "post_attention_norm"),))

FAMILY = Family(name="qwen35", hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                hf_model_type="qwen3_5_text", hf_other_model_types=("qwen3_5",), hf_layer_names=_LAYER_NAMES, **_COMMON)

MOE_FAMILY = Family(name="qwen35moe", hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                    hf_model_type="qwen3_5_moe_text", hf_other_model_types=("qwen3_5_moe",),
                    hf_layer_names=_LAYER_NAMES + _EXPERT_NAMES,
                    shared_expert_gate=True, gguf_expert_weights_norm=True, hf_expert_weights_norm=True,
                    gguf_reshaped=("ffn_gate_inp_shexp.weight",), **_COMMON)

FAMILIES = (FAMILY, MOE_FAMILY)
