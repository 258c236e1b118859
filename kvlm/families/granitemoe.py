"""Granite MoE (IBM's granite-3.x-1b-a400m and 3b-a800m; with a shared expert, GraniteMoeShared): Llama's attention
and experts (softmax over the top k's logits: renormalised), and Granite's multipliers: embeddings times one,
attention scores scaled by another (in place of 1/sqrt(head_dim)), each layer output times a third before its
residual add, logits divided by a fourth."""
from kvlm.core.family import Family

FAMILY = Family(name="granitemoe", hf_architectures=("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"),
                hf_model_type="granitemoe", hf_other_model_types=("granitemoeshared",), gguf_expert_weights_norm=True,
                hf_expert_weights_norm=True, granite_multipliers=True,
                hf_layer_names=(("block_sparse_moe.router.layer", "ffn_gate_inp"),
                                ("block_sparse_moe.output_linear", "ffn_down_exps"),
                                ("shared_mlp.output_linear", "ffn_down_shexp")))

FAMILIES = (FAMILY,)
