"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's attention, and experts in place of the
MLP: softmax routing in float32 over all experts, the top k kept, their weights renormalised when the file says
(config.json's norm_topk_prob, False by transformers' default and True in the released models; llama.cpp always
renormalises, so a GGUF file that does not say is renormalised). `mlp_only_layers` and `decoder_sparse_step` keep a
plain MLP in some layers."""
from kvlm.core.family import Family

FAMILY = Family(name="qwen3moe", hf_architectures=("Qwen3MoeForCausalLM",), hf_model_type="qwen3_moe", qk_norm=True,
                default_head_dim=128, gguf_expert_weights_norm=True,
                hf_layer_names=(("mlp.gate", "ffn_gate_inp"),))

FAMILIES = (FAMILY,)
