"""Gemma 4's chat template (tests/data/gemma4-chat-template.jinja, its provenance in test_gemma4_chat.py) and GGUF
metadata of a byte-level vocabulary with Gemma 4's chat tokens carrying it."""
from __future__ import annotations

from helpers import DATA
from helpers.gguf_factory import SPECIAL_TOKENS, byte_level_vocab, gguf_metadata, llama_config

TEMPLATE_PATH = DATA / "gemma4-chat-template.jinja"
# read_bytes + decode, not read_text: universal newlines would hide a stray \r
TEMPLATE = TEMPLATE_PATH.read_bytes().decode("utf-8")

BOS, EOS = "<bos>", "<eos>"
CHAT_TOKENS = ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>",
               "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|image|>", "<|audio|>", "<|video|>")
BYTE_LEVEL_SIZE = 1000
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types


def gemma4_chat_metadata(template: str = TEMPLATE) -> dict:
    """GGUF metadata of the byte-level vocabulary, then <bos>, <eos> (control) and Gemma 4's chat tokens
    (user-defined), carrying the template."""
    config = llama_config(vocab_size=BYTE_LEVEL_SIZE + 2 + len(CHAT_TOKENS))
    tokens, merges = byte_level_vocab(BYTE_LEVEL_SIZE)
    tokens = [*tokens, BOS, EOS, *CHAT_TOKENS]
    control = {*SPECIAL_TOKENS, BOS, EOS}
    types = [_CONTROL if t in control else _USER_DEFINED if t in CHAT_TOKENS else _NORMAL for t in tokens]
    return {**gguf_metadata(config), "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": tokens.index(BOS),
            "tokenizer.ggml.eos_token_id": tokens.index(EOS), "tokenizer.chat_template": template}
