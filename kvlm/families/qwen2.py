"""Qwen2 and Qwen2.5: Llama plus biases on the Q, K and V projections."""
from kvlm.core.family import Family

FAMILY = Family(name="qwen2", hf_architectures=("Qwen2ForCausalLM",), hf_model_type="qwen2", qkv_bias=True)

FAMILIES = (FAMILY,)
