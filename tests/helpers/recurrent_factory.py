"""Random recurrent models that transformers builds, and the GGUF files llama.cpp's converters write of them: LFM2
(short-convolution layers interleaved with GQA attention layers: the hybrid memory) and Mamba2 (every layer a Mamba2
mixer: the recurrent memory alone), tensor names from the gguf package's own map. For test_recurrent_models and every
module that needs a recurrent model."""
from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, Mamba2Config, Mamba2ForCausalLM

from helpers.gguf_factory import gguf_metadata, write_gguf

VOCAB = 1024  # a multiple of 16: llama.cpp's Mamba2 converter pads the vocabulary to one
LAYER_TYPES = ["conv", "conv", "full_attention", "conv", "full_attention", "conv"]


def random_lfm2() -> Lfm2ForCausalLM:
    config = Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, layer_types=LAYER_TYPES, conv_L_cache=3,
        max_position_embeddings=512, block_multiple_of=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(11)
    model = Lfm2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.12)
    return model


def random_mamba2() -> Mamba2ForCausalLM:
    """Time steps, decays and D spread so the state both remembers and forgets within a prompt."""
    config = Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                          expand=2, conv_kernel=4, num_hidden_layers=3, chunk_size=16, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(12)
    model = Mamba2ForCausalLM(config).eval()
    spread = {"A_log": (-1.0, 1.0), "dt_bias": (-2.0, 0.0), ".D": (0.5, 1.5), "norm.weight": (0.5, 1.5),
              "norm_f.weight": (0.5, 1.5)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            low_high = next((r for suffix, r in spread.items() if name.endswith(suffix)), None)
            param.uniform_(*low_high) if low_high else param.normal_(0.0, 0.1)
    return model


def mamba2_gguf(model: Mamba2ForCausalLM, path, quant=gguf.GGMLQuantizationType.F32, extra: dict | None = None):
    """As llama.cpp's Mamba2Model converter writes it: A = -exp(A_log) and D as [H, 1], the gated norm as
    [groups, d_inner / groups], conv weights squeezed, dt_bias as ssm_dt.bias; its ssm.* keys."""
    c = model.config
    inner = c.expand * c.hidden_size
    metadata = {key: value for key, value in gguf_metadata(_shim(c, 0, c.layer_norm_epsilon), "mamba2").items()
                if not key.startswith(("mamba2.attention.head_count", "mamba2.attention.key", "mamba2.attention.value",
                                       "mamba2.rope"))}
    metadata.update({"mamba2.attention.head_count": 0, "mamba2.ssm.conv_kernel": c.conv_kernel,
                     "mamba2.ssm.inner_size": inner, "mamba2.ssm.state_size": c.state_size,
                     "mamba2.ssm.time_step_rank": inner // c.head_dim, "mamba2.ssm.group_count": c.n_groups,
                     "mamba2.context_length": 2**20, **(extra or {})})
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA2, c.num_hidden_layers)
    tensors = {}
    for name, value in model.state_dict().items():
        array = value.float().numpy()
        hf = name.replace(".dt_bias", ".dt_proj.bias")
        if name.endswith("A_log"):
            array = -np.exp(array)
        if name.endswith(("A_log", ".D")):
            array = array.reshape(-1, 1)
        elif name.endswith("mixer.norm.weight"):
            array = array.reshape(c.n_groups, -1)
        key = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        tensors[key] = array.squeeze(1) if array.ndim == 3 else array
    return write_gguf(path / "model.gguf", metadata, tensors, arch="mamba2", quant=quant,
                      keep_f32=("ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight"))


def _shim(config, n_ff: int, eps: float) -> SimpleNamespace:
    """What gguf_metadata reads, from a config that is not Llama's."""
    heads = getattr(config, "num_attention_heads", 1)
    return SimpleNamespace(num_hidden_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                           max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
                           intermediate_size=n_ff, num_attention_heads=heads,
                           num_key_value_heads=getattr(config, "num_key_value_heads", heads),
                           head_dim=config.hidden_size // heads, rms_norm_eps=eps, vocab_size=config.vocab_size,
                           rope_parameters=getattr(config, "rope_parameters", None) or {"rope_theta": 10000.0})


def lfm2_gguf(model: Lfm2ForCausalLM, path, quant=gguf.GGMLQuantizationType.F32, extra: dict | None = None):
    """As llama.cpp's converter writes LFM2: per-layer KV head counts (0 for a conv layer), shortconv.l_cache, the
    MLP's real width, conv weights squeezed to [channels, width], names from gguf's TensorNameMap."""
    c = model.config
    n_ff = model.model.layers[0].feed_forward.w1.out_features
    metadata = gguf_metadata(_shim(c, n_ff, c.norm_eps), "lfm2")
    metadata["lfm2.attention.head_count_kv"] = [0 if t == "conv" else c.num_key_value_heads for t in c.layer_types]
    metadata["lfm2.shortconv.l_cache"] = c.conv_L_cache
    metadata.update(extra or {})
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        array = value.float().numpy()
        tensors[names.get_name(name, try_suffixes=(".weight",))] = array.squeeze(1) if array.ndim == 3 else array
    return write_gguf(path / "model.gguf", metadata, tensors, arch="lfm2", quant=quant,
                      keep_f32=("shortconv.conv.weight",))  # llama.cpp's ssm_conv reads F32 weights only
