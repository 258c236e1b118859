"""LFM2 (Liquid AI): a hybrid of gated short-convolution layers and GQA attention layers with QK-norm, each
followed by a SwiGLU MLP; the final norm is the one transformers names embedding_norm."""
from kvlm.core.family import Family


def hf_ff_size(config: dict) -> int:
    """transformers' Lfm2MLP: with block_auto_adjust_ff_dim, 2/3 of intermediate_size, then (with a multiplier)
    times the multiplier rounded up to block_multiple_of."""
    size = config["intermediate_size"]
    if not config.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return size
    step = config.get("block_multiple_of", 256)
    return step * ((int(multiplier * size) + step - 1) // step)


def conv_shapes(c) -> dict[str, tuple]:
    """A gated short convolution's tensors: B, C and x from one projection, the depthwise kernel, the output."""
    n_embd = c.n_embd
    return {"shortconv.in_proj.weight": (3 * n_embd, n_embd), "shortconv.conv.weight": (n_embd, c.conv_kernel),
            "shortconv.out_proj.weight": (n_embd, n_embd)}


FAMILY = Family(
    name="lfm2", hf_architectures=("Lfm2ForCausalLM",), hf_model_type="lfm2", qk_norm=True,
    hf_layer_names=(("operator_norm", "attn_norm"), ("ffn_norm", "ffn_norm"), ("self_attn.out_proj", "attn_output"),
                    ("self_attn.q_layernorm", "attn_q_norm"), ("self_attn.k_layernorm", "attn_k_norm"),
                    ("feed_forward.w1", "ffn_gate"), ("feed_forward.w3", "ffn_up"), ("feed_forward.w2", "ffn_down"),
                    ("conv.in_proj", "shortconv.in_proj"), ("conv.conv", "shortconv.conv"),
                    ("conv.out_proj", "shortconv.out_proj")),
    hf_global_names=(("model.embedding_norm", "output_norm"),), hf_ff_size=hf_ff_size,
    recurrent_shapes=conv_shapes,
    gguf_names=(("output_norm.weight", "token_embd_norm.weight"),),  # llama.cpp's LFM2 normalizes its output with it
)

FAMILIES = (FAMILY,)
