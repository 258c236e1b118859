"""A tiny random gpt-oss that transformers makes (never hub weights), as a Hugging Face folder (what save_pretrained
writes: experts as [expert, in, out] tensors, gate and up columns interleaved) and as a GGUF file written as
llama.cpp's converter (its GptOssModel) writes one from such a folder: experts transposed to [expert, out, in], gate
and up split into the even and the odd rows, their biases likewise, the sinks as attn_sinks.weight, the
post-attention norm as post_attention_norm; the experts in MXFP4 if asked (as the converter keeps OpenAI's)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

from helpers.family_factory import randomized_norms_and_biases, rope_scaling_metadata
from helpers.gguf_factory import BOS_ID, EOS_ID, gguf_metadata, save_hf_folder, write_gguf

ARCH = "gpt-oss"
WINDOW = 8  # the sliding layers' window: prompts in the tests run well past it
CONFIG = dict(vocab_size=1000, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.15,
              num_local_experts=6, num_experts_per_tok=2, sliding_window=WINDOW, bos_token_id=BOS_ID,
              eos_token_id=EOS_ID, tie_word_embeddings=False,
              # the released models' YaRN (factor 32, not truncated) over a short original context, so it matters
              rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})


def random_gpt_oss(seed: int = 21) -> GptOssForCausalLM:
    """transformers' model with random weights made to exercise what gpt-oss adds: sinks large enough that heads
    give them much of their attention, experts' gate products wide enough that the clamp at 7 cuts many, experts'
    biases that are not zero (transformers initialises them to zero)."""
    torch.manual_seed(seed)
    config = GptOssConfig(**CONFIG, attn_implementation="eager")  # transformers' own reference attention
    model = randomized_norms_and_biases(GptOssForCausalLM(config).eval())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.normal_(0.0, 1.5)
            elif name.endswith("experts.gate_up_proj"):
                parameter.mul_(5.0)
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                parameter.normal_(0.0, 0.5)
    return model


def save_gpt_oss_folder(model: GptOssForCausalLM, folder: Path) -> Path:
    return save_hf_folder(model, folder)


def gguf_tensors(model: GptOssForCausalLM) -> dict[str, np.ndarray]:
    """The model's tensors as the converter names and lays them out."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, model.config.num_hidden_layers)
    tensors = {}
    for name, value in model.state_dict().items():
        value = value.float()
        if ".mlp.experts." in name:
            tensors.update(_experts(name, value))
            continue
        stem, _, kind = name.rpartition(".")
        if kind == "sinks":  # a parameter named as a whole: the converter adds ".weight"
            tensors[f"{names.get_name(name)}.weight"] = value.numpy()
        else:
            tensors[f"{names.get_name(stem)}.{kind}"] = value.numpy()
    return tensors


def _experts(name: str, value: torch.Tensor) -> dict[str, np.ndarray]:
    block = f"blk.{name.split('.')[2]}"
    part = name.rpartition(".")[2]
    if part == "down_proj":
        return {f"{block}.ffn_down_exps.weight": value.transpose(1, 2).contiguous().numpy()}
    if part == "down_proj_bias":
        return {f"{block}.ffn_down_exps.bias": value.numpy()}
    rows = value.transpose(1, 2) if part == "gate_up_proj" else value  # bias: [expert, 2 n_ff]
    kind = "weight" if part == "gate_up_proj" else "bias"
    return {f"{block}.ffn_gate_exps.{kind}": rows[:, ::2].contiguous().numpy(),
            f"{block}.ffn_up_exps.{kind}": rows[:, 1::2].contiguous().numpy()}


def gguf_metadata_of(model: GptOssForCausalLM) -> dict:
    config = copy.deepcopy(model.config)
    metadata = gguf_metadata(config, ARCH)
    metadata.update({
        "general.name": "tiny-random-gpt-oss", "tokenizer.ggml.pre": "gpt-4o",  # the converter's, for o200k
        f"{ARCH}.expert_count": config.num_local_experts,
        f"{ARCH}.expert_used_count": config.num_experts_per_tok,
        f"{ARCH}.expert_feed_forward_length": config.intermediate_size,
        f"{ARCH}.attention.sliding_window": config.sliding_window,
        **rope_scaling_metadata(config.rope_parameters, ARCH)})
    return metadata


# What stays F32 in write_gpt_oss_gguf (name endings): the converter keeps OpenAI's MXFP4 experts beside float
# weights; the router and every bias stay F32 in any case.
_FLOAT = ("token_embd.weight", "ffn_gate_inp.weight", "_exps.bias")
_NOT_EXPERTS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "output.weight")  # attn_output's and the head's


def write_gpt_oss_gguf(model: GptOssForCausalLM, path: Path, experts: GGMLQuantizationType = GGMLQuantizationType.F32,
                       all_matrices: bool = False) -> Path:
    """The experts' matrices stored as `experts` says (and every other matrix too, if `all_matrices`), the rest F32."""
    keep_f32 = _FLOAT if all_matrices else _FLOAT + _NOT_EXPERTS
    return write_gguf(path, gguf_metadata_of(model), gguf_tensors(model), arch=ARCH, quant=experts, keep_f32=keep_f32)


def load_gguf_experts_into(model: GptOssForCausalLM, path: Path) -> GptOssForCausalLM:
    """A copy of `model` holding the experts' values a GGUF file stores (gguf's dequantization of its blocks): the
    reference for a file whose experts are quantized."""
    reader = gguf.GGUFReader(path)
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(copied.model.layers):
            gate, up = (torch.from_numpy(stored[f"blk.{i}.ffn_{p}_exps.weight"].copy()) for p in ("gate", "up"))
            interleaved = torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2])  # gate even rows
            layer.mlp.experts.gate_up_proj.copy_(interleaved.transpose(1, 2))
            down = torch.from_numpy(stored[f"blk.{i}.ffn_down_exps.weight"].copy())
            layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))
    return copied


def openai_mxfp4(ggml_blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's MXFP4 bytes [..., G * 17] as OpenAI's folders store them: blocks [..., G, 16] (byte j: weight 2j in its
    low nibble, 2j + 1 in its high one) and scales [..., G] (the same E8M0 byte)."""
    raw = torch.from_numpy(ggml_blocks.copy()).view(*ggml_blocks.shape[:-1], -1, 17)
    scales, packed = raw[..., 0], raw[..., 1:]
    codes = torch.cat([packed & 15, packed >> 4], dim=-1)  # weights 0-15 low, 16-31 high: in weight order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


def save_mxfp4_folder(model: GptOssForCausalLM, folder: Path) -> Path:
    """The folder as OpenAI releases gpt-oss: experts' matrices in MXFP4 (gate_up_proj_blocks/_scales with gate and
    up rows interleaved, down_proj_blocks/_scales), quantized by gguf's MXFP4 quantizer (the same blocks as
    write_gpt_oss_gguf's), and a quantization_config saying so."""
    save_gpt_oss_folder(model, folder)
    file = folder / "model.safetensors"
    with safe_open(file, "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    gguf_named = gguf_tensors(model)
    for i in range(model.config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        gate, up, down = (quantize(gguf_named[f"blk.{i}.ffn_{p}_exps.weight"], GGMLQuantizationType.MXFP4)
                          for p in ("gate", "up", "down"))
        interleaved = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[-1])  # gate even rows
        for part, blocks in (("gate_up_proj", interleaved), ("down_proj", down)):
            del tensors[f"{prefix}.{part}"]
            tensors[f"{prefix}.{part}_blocks"], tensors[f"{prefix}.{part}_scales"] = openai_mxfp4(blocks)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
