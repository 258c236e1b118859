"""Tiny random Llama models made by transformers, saved as a Hugging Face folder or as GGUF files.

The GGUF files are written the way llama.cpp's convert script writes them (same metadata keys, Q and K
rows permuted for its RoPE layout, norms kept in F32 when quantizing), so reading them back checks the
loaders independently of any real checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvlm.loader.hf_folder import gguf_name

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>")
BOS_ID, EOS_ID = 0, 0
_MERGE_ALPHABET = "Ġ" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # Ġ is the byte alphabet's space
_NORMAL, _CONTROL = 1, 3  # llama.cpp token types


def llama_config(
    *,
    vocab_size: int = 1000,
    hidden_size: int = 64,
    n_head: int = 4,
    n_head_kv: int = 4,
    n_layer: int = 2,
    intermediate_size: int = 160,
    head_dim: int | None = None,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-5,
    tie_word_embeddings: bool = True,
) -> LlamaConfig:
    extra = {} if head_dim is None else {"head_dim": head_dim}
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head_kv,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=256,
        # Far above the default 0.02, so attention is far from uniform and logits far from flat:
        # a mistake in RoPE or head grouping then moves the logits well past the tolerance.
        initializer_range=0.15,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **extra,
    )


def random_llama(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norm weights too, so a norm read from the wrong tensor shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """Special tokens, the 256 byte-level characters, then merged pairs until the vocabulary is full."""
    tokens = [*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    pairs = ((a, b) for a in _MERGE_ALPHABET for b in _MERGE_ALPHABET if b != "Ġ")
    merges = []
    for a, b in pairs:
        if len(tokens) == vocab_size:
            break
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    return tokens, merges


def byte_level_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer of `byte_level_vocab`, as transformers holds it."""
    tokens, merges = byte_level_vocab(vocab_size)
    backend = Backend(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = SPECIAL_TOKENS[BOS_ID]
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=special, eos_token=special)


def template_folder_tokenizers(folder: Path, template: bytes):
    """A Hugging Face folder of the byte-level tokenizer with `template` as its chat_template.jinja (as recent models
    ship it), read by kvlm and by transformers: (kvlm's Tokenizer, transformers' tokenizer)."""
    from kvlm.text.tokenizer import Tokenizer

    byte_level_tokenizer(1000).save_pretrained(folder)
    (folder / "chat_template.jinja").write_bytes(template)
    return Tokenizer.from_hf_folder(folder), PreTrainedTokenizerFast.from_pretrained(folder)


def save_hf_folder(model: LlamaForCausalLM, folder: Path) -> Path:
    """config.json, safetensors weights and a byte-level BPE tokenizer over the model's vocabulary."""
    model.save_pretrained(folder)
    byte_level_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def permute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time permutation of Q/K rows: the inverse of kvlm's unpermute_rope_rows."""
    rows, cols = weight.shape
    return weight.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights by GGUF name, Q and K permuted as llama.cpp stores them."""
    config = model.config
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = value.float().numpy().copy()
        name = gguf_name(name)
        if ".attn_q." in name:
            array = permute_rope_rows(array, config.num_attention_heads)
        elif ".attn_k." in name:
            array = permute_rope_rows(array, config.num_key_value_heads)
        tensors[name] = array
    return tensors


def gguf_metadata(config: LlamaConfig, arch: str = "llama") -> dict[str, Any]:
    """The llama.cpp keys of a Llama model plus a byte-level BPE tokenizer."""
    head_dim = config.head_dim
    tokens, merges = byte_level_vocab(config.vocab_size)
    return {
        "general.name": "tiny-random-llama",
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{arch}.vocab_size": config.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [_CONTROL if t in SPECIAL_TOKENS else _NORMAL for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": BOS_ID,
        "tokenizer.ggml.eos_token_id": EOS_ID,
    }


def write_gguf(
    path: Path,
    metadata: dict[str, Any],
    tensors: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    quant: GGMLQuantizationType = GGMLQuantizationType.F32,
    keep_f32: tuple[str, ...] = (),
    split_max_tensors: int = 0,
    blocks_of: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> Path:
    """`keep_f32`: name endings of matrices llama.cpp's converter keeps in F32 whatever the file type;
    `split_max_tensors` > 0: written in parts of at most that many tensors, as llama.cpp's converter does with
    --split-max-tensors (PATH-00001-of-0000N.gguf, ...; the first part's path returned); `blocks_of(name, array)`:
    a matrix's blocks of type `quant` written instead of gguf's quantization of it (for the types gguf cannot
    quantize)."""
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, value in metadata.items():
        add_value(writer, key, value)
    for name, array in tensors.items():
        if quant == GGMLQuantizationType.F32 or array.ndim == 1 or name.endswith(keep_f32):  # and norms in F32
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            blocks = blocks_of(name, array) if blocks_of else quantize(array, quant)
            writer.add_tensor(name, blocks, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    parts = writer.format_shard_names(Path(path))
    writer.close()
    return parts[0]


def write_model_gguf(
    model: LlamaForCausalLM, path: Path, quant: GGMLQuantizationType = GGMLQuantizationType.F32
) -> Path:
    return write_gguf(path, gguf_metadata(model.config), gguf_tensors(model), quant=quant)


def add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    # Typed by hand: gguf would store a Python int as INT32, llama.cpp writes UINT32 for these keys.
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)
