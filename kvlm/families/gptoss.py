"""gpt-oss (OpenAI's gpt-oss-20b and gpt-oss-120b): attention with biases on all four projections and a learned
sink logit per head in each softmax (a head may attend to nothing), a 128-position sliding window on every other
layer (the first slides) with the same YaRN RoPE as the full layers (its correction range not rounded, as OpenAI's
reference and transformers compute it: llama.cpp rounds it), and experts in every layer: the router's logits (with
a bias) pick the top k, a softmax over those k weighs them (the same as a softmax over all, renormalised), and each
expert's gate and up products (with biases) meet in a clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate) with the
gate clamped above at 7 and up to [-7, 7], before its down product (with a bias). Its chat format (harmony) comes
from the file's template."""
from kvlm.core.family import Family

FAMILY = Family(
    name="gpt-oss", hf_architectures=("GptOssForCausalLM",), hf_model_type="gpt_oss", qkv_bias=True,
    output_bias=True, attention_sinks=True, sliding_period=2, sliding_rope_base=False, activation="swiglu_oai",
    expert_biases=True, gguf_expert_weights_norm=True, hf_expert_weights_norm=True, hf_experts_interleaved=True,
    gguf_yarn_truncate=False, default_head_dim=64,
    hf_layer_names=(("mlp.router", "ffn_gate_inp"), ("self_attn.sinks", "attn_sinks.weight")),
    gguf_layer_names=(("ffn_norm", "post_attention_norm"),),
)

FAMILIES = (FAMILY,)
