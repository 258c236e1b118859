"""Qwen3: no biases, RMSNorm over head_dim on Q and K before RoPE, head_dim set apart from hidden/heads."""
from kvlm.core.family import Family

FAMILY = Family(name="qwen3", hf_architectures=("Qwen3ForCausalLM",), hf_model_type="qwen3", qk_norm=True,
                default_head_dim=128)

FAMILIES = (FAMILY,)
