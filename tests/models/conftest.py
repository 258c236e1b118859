"""The models folder's shared fixtures: the real Gemma 3 270M file's GGUF metadata and kvlm's tokenizer of it, for
test_gemma_tokenizer and test_gemma_chat."""
from __future__ import annotations

import pytest

from kvlm.loader.gguf_reader import read_gguf_metadata
from kvlm.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def metadata(gemma_gguf_path) -> dict:
    return read_gguf_metadata(gemma_gguf_path)


@pytest.fixture(scope="module")
def tokenizer(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)
