"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention with Q/K/V biases, experts routed as
Qwen3-MoE's (not renormalised unless the file says), and a shared expert every token goes through, its output
times sigmoid(w . x)."""
from kvlm.core.family import Family

FAMILY = Family(name="qwen2moe", hf_architectures=("Qwen2MoeForCausalLM",), hf_model_type="qwen2_moe", qkv_bias=True,
                shared_expert_gate=True,
                hf_layer_names=(("mlp.gate", "ffn_gate_inp"), ("mlp.shared_expert_gate", "ffn_gate_inp_shexp"),
                                ("mlp.shared_expert.gate_proj", "ffn_gate_shexp"),
                                ("mlp.shared_expert.up_proj", "ffn_up_shexp"),
                                ("mlp.shared_expert.down_proj", "ffn_down_shexp")),
                gguf_reshaped=("ffn_gate_inp_shexp.weight",))  # llama.cpp reads it as a vector of n_embd

FAMILIES = (FAMILY,)
