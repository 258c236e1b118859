"""A random Gemma 3 that transformers builds (MQA, QK-norm, sandwich norms, GeGLU, a window of 8 positions, linear
RoPE scaling on its full layer, another base on its sliding ones; layer 5 of 7 is full) and the GGUF llama.cpp's
converter writes of it: for test_gemma3 and every module that needs an iSWA model."""
from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from helpers.family_factory import rope_scaling_metadata
from helpers.gguf_factory import BOS_ID, EOS_ID, gguf_metadata, write_gguf
from kvlm.families import gemma3
from kvlm.loader.hf_folder import gguf_name

WINDOW = 8
FULL_ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}
LOCAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def random_gemma3(query_pre_attn_scalar: int = 32, num_key_value_heads: int = 1) -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=192, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=num_key_value_heads, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=query_pre_attn_scalar,
        rope_parameters={"full_attention": FULL_ROPE, "sliding_attention": LOCAL_ROPE},
        max_position_embeddings=256, initializer_range=0.15, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    torch.manual_seed(7)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)  # multiplied as 1 + w
    return model


def gguf_of(model: Gemma3ForCausalLM, path):
    """The model as llama.cpp's Gemma3Model converter writes it: norms + 1, the window, the full layers' RoPE."""
    config = model.config
    metadata = gguf_metadata(_with_rope_theta(config), "gemma3")
    metadata["gemma3.attention.sliding_window"] = config.sliding_window
    metadata.update(rope_scaling_metadata(FULL_ROPE, "gemma3"))
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        array = value.float().numpy().copy()
        tensors[gguf_name(name, gemma3.FAMILY)] = array + 1 if name.endswith("norm.weight") else array
    return write_gguf(path / "model.gguf", metadata, tensors, arch="gemma3")


def _with_rope_theta(config):
    """gguf_metadata reads one rope_theta: the full layers' (llama.cpp's gemma3.rope.freq_base)."""
    copy = Gemma3TextConfig.from_dict(config.to_dict())
    copy.rope_parameters = dict(FULL_ROPE)
    return copy
