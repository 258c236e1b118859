"""Llama 2/3.x and SmolLM2: the plain pre-norm decoder with GQA, SwiGLU and RoPE (any scaling)."""
from kvlm.families.family import Family

FAMILY = Family(name="llama", hf_architectures=("LlamaForCausalLM",), hf_model_type="llama", permuted_qk=True)
