"""Llama 2/3.x and SmolLM2: the plain pre-norm decoder with GQA, SwiGLU and RoPE (any scaling). Mixtral is a Llama
whose MLPs are experts (llama.cpp's `llama` architecture with expert keys): softmax top-2, renormalised."""
from kvlm.core.family import Family

FAMILY = Family(name="llama", hf_architectures=("LlamaForCausalLM", "MixtralForCausalLM"), hf_model_type="llama",
                hf_other_model_types=("mixtral",), permuted_qk=True, gguf_expert_weights_norm=True, hf_expert_weights_norm=True,
                hf_layer_names=(("block_sparse_moe.gate", "ffn_gate_inp"),))

FAMILIES = (FAMILY,)
