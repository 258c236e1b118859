"""kvlm's logits through Context and generate, transformers' (and llama.cpp's) as the reference, and the models
behind them: transformers' reading of a GGUF, kvlm's with or without its native kernels, on two ranks, a module's
zoo of random models."""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
import transformers

from kvlm import Batch, Context, DecodeStatus


def hf_model_of(gguf_path):
    """transformers' own reading of a GGUF, dequantized to float32: the independent reference (kept between runs, see
    helpers.references)."""
    pytest.importorskip("transformers")
    from helpers.references import reference_model

    return reference_model(gguf_path)


def hf_tokenizer_of(gguf_path):
    pytest.importorskip("transformers")
    from helpers.references import reference_tokenizer

    return reference_tokenizer(gguf_path)


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


def token_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


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


def pool_state(ctx: Context) -> list:
    """Every pool's bookkeeping and the K/V bytes of its used cells: what a refused or rolled-back operation must
    leave as it was (free cells may hold anything)."""
    states = []
    for pool in ctx.memory.pools:
        used = torch.from_numpy(np.flatnonzero(pool.cells.pos >= 0))
        states.append((pool.cells.pos.copy(), pool.cells.seqs.copy(), pool.cells.shift.copy(),
                       pool.store.k.data[:, used].clone(), pool.store.v.data[:, used].clone()))
    return states


def assert_same_state(a: list, b: list) -> None:
    for pool_a, pool_b in zip(a, b):
        for x, y in zip(pool_a, pool_b):
            assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else torch.equal(x, y))


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
