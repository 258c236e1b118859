"""OLMoE (AllenAI's OLMoE-1B-7B): Llama's layout with a QK-norm over each token's whole Q and K projections (before
they are cut into heads), and experts in every layer whose weights are the softmax probabilities as they are (never
renormalised)."""
from kvlm.core.family import Family

FAMILY = Family(name="olmoe", hf_architectures=("OlmoeForCausalLM",), hf_model_type="olmoe", qk_norm=True,
                qk_norm_whole=True, hf_layer_names=(("mlp.gate", "ffn_gate_inp"),))

FAMILIES = (FAMILY,)
