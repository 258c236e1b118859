"""A tiny byte-level vocabulary with OpenAI's harmony special tokens after it, as control tokens, and gpt-oss's chat
template: the GGUF metadata a gpt-oss file's tokenizer part has in miniature (its EOS is <|return|>, as the files
of openai/gpt-oss say), and a random Llama over it (the family does not matter to reading the output)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import DATA
from helpers.gguf_factory import SPECIAL_TOKENS, byte_level_vocab, gguf_metadata, gguf_tensors, llama_config, \
    random_llama, write_gguf

from kvlm.text.tokenizer import Tokenizer

TEMPLATE = (DATA / "gpt-oss-chat-template.jinja").read_bytes().decode("utf-8")
HARMONY_TOKENS = ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")
BYTE_LEVEL_SIZE = 1000
VOCAB_SIZE = BYTE_LEVEL_SIZE + len(HARMONY_TOKENS)
N_CTX = 2048  # the harmony system and developer messages alone are several hundred byte-level tokens
_NORMAL, _CONTROL = 1, 3  # llama.cpp token types


def harmony_metadata(config=None) -> dict[str, Any]:
    config = config or llama_config(vocab_size=VOCAB_SIZE)
    config.max_position_embeddings = N_CTX
    tokens, merges = byte_level_vocab(BYTE_LEVEL_SIZE)
    tokens = [*tokens, *HARMONY_TOKENS]
    return {**gguf_metadata(config),
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [_CONTROL if t in (*SPECIAL_TOKENS, *HARMONY_TOKENS) else _NORMAL
                                          for t in tokens],
            "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"),
            "tokenizer.chat_template": TEMPLATE}


def harmony_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(harmony_metadata())


def write_harmony_gguf(path: Path) -> Path:
    config = llama_config(vocab_size=VOCAB_SIZE)
    return write_gguf(path, harmony_metadata(config), gguf_tensors(random_llama(config)))
