"""Embeddings (LLM.embed, Engine.add_request(pooling=...)) against transformers on random-weight models.

The reference is transformers' base model (`model.model`, whose last_hidden_state is the final norm's output),
pooled as the pooling says (last token, mean, first token) and L2-normalized, in float32. kvlm reads the same
weights from a transformers folder and from a GGUF, computes the prompts through its engine, batched with each
other and with generating requests, in chunks, with prefix reuse, and must agree: cosine >= 0.999 and every value
within 1e-4.
"""
from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
import torch

from helpers.family_factory import SPECS, random_model, save_model
from helpers.models import ModelZoo, token_ids
from helpers.qwen35_factory import random_qwen35, write_qwen35_gguf
from helpers.recurrent_factory import lfm2_gguf, mamba2_gguf, random_lfm2, random_mamba2
from kvlm.engine.engine import Engine
from kvlm.engine.llm import LLM
from kvlm.engine.pooling import truncated
from kvlm.loader.gguf_file import config_from_metadata
from kvlm.loader.gguf_reader import GGUFFile
from kvlm.loader.load import load_model
from kvlm.sampling.params import SamplingParams

NAMES = ("llama-llama3", "qwen2", "qwen3")
LENGTHS = (1, 7, 40, 97)  # one token, short, and longer than a chunk of max_num_batched_tokens
TOLERANCE = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> ModelZoo:
    return ModelZoo(tmp_path_factory, lambda name: random_model(SPECS[name]),
                    lambda model, name, source, folder: save_model(model, SPECS[name], source, folder))


def reference_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        states = hf_model.base_model(torch.tensor([ids])).last_hidden_state[0].float()
    pooled = {"last": states[-1], "mean": states.mean(dim=0), "cls": states[0]}[pooling]
    return pooled / pooled.norm()


def assert_close(ours: list[float], theirs: torch.Tensor) -> None:
    ours = torch.tensor(ours)
    cosine = float(ours @ theirs / (ours.norm() * theirs.norm()))
    assert cosine >= 0.999 and float((ours - theirs).abs().max()) <= TOLERANCE, (cosine, (ours - theirs).abs().max())


def prompts(vocab_size: int) -> list[list[int]]:
    return [token_ids(vocab_size, n, seed=n) for n in LENGTHS]


@pytest.mark.parametrize("source", ["hf-new", "gguf"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("name", NAMES)
def test_embeddings_equal_transformers(zoo, name, source, pooling):
    model = zoo.ours(name, source)
    llm = LLM(model, n_ctx=256, max_num_seqs=4, max_num_batched_tokens=32)  # chunks of at most 32 tokens
    batch = prompts(model.config.vocab_size)
    outputs = llm.embed(batch, pooling=pooling, use_tqdm=False)
    for ids, output in zip(batch, outputs):
        assert output.prompt_token_ids == ids and output.token_ids == []
        assert len(output.embedding) == model.config.n_embd
        assert_close(output.embedding, reference_embedding(zoo.reference(name), ids, pooling))


RECURRENT = {"lfm2": (random_lfm2, lfm2_gguf), "mamba2": (random_mamba2, mamba2_gguf),
             "qwen35": (random_qwen35, lambda model, folder: write_qwen35_gguf(model, folder / "model.gguf"))}


@pytest.mark.parametrize("family", list(RECURRENT))
def test_recurrent_and_hybrid_models_embed_as_transformers(family, tmp_path):
    """Memories with recurrent states (hybrid LFM2 and Qwen3.5, Mamba2's recurrent memory alone), in chunks."""
    make, write = RECURRENT[family]
    reference = make()
    model = load_model(str(write(reference, tmp_path)), "float32", progress=False)
    llm = LLM(model, n_ctx=256, max_num_seqs=4, max_num_batched_tokens=32)
    batch = prompts(model.config.vocab_size)
    for pooling in ("last", "mean"):
        for ids, output in zip(batch, llm.embed(batch, pooling=pooling, use_tqdm=False)):
            assert_close(output.embedding, reference_embedding(reference, ids, pooling))


def test_embeddings_beside_generation_change_neither(zoo):
    """Embedding and generating requests in the same steps: each result is what it is alone."""
    model, name = zoo.ours("qwen3", "gguf"), "qwen3"
    batch = prompts(model.config.vocab_size)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = Engine(model, n_ctx=256, max_num_seqs=8, max_num_batched_tokens=32)
    generated_alone = [alone.add_request(ids, greedy) for ids in batch[1:3]]
    while alone.has_unfinished():
        alone.step()
    expected = [alone.release(i).token_ids for i in generated_alone]

    engine = Engine(model, n_ctx=256, max_num_seqs=8, max_num_batched_tokens=32)
    generating = [engine.add_request(ids, greedy) for ids in batch[1:3]]
    embedding = [engine.add_request(ids, SamplingParams(max_tokens=1), pooling="mean") for ids in batch]
    shared_steps = 0
    while engine.has_unfinished():
        running = {r.request_id for r in engine.scheduler.running}
        shared_steps += bool(running & set(generating)) and bool(running & set(embedding))
        engine.step()
    assert shared_steps > 0  # the two kinds did run in the same steps
    assert [engine.release(i).token_ids for i in generating] == expected
    for ids, request_id in zip(batch, embedding):
        assert_close(engine.release(request_id).embedding, reference_embedding(zoo.reference(name), ids, "mean"))


def test_last_token_pooling_reuses_a_cached_prefix(zoo):
    model = zoo.ours("qwen2", "gguf")
    llm = LLM(model, n_ctx=256, max_num_seqs=2, max_num_batched_tokens=64)
    ids = token_ids(model.config.vocab_size, 60, seed=3)
    first, again = llm.embed([ids], use_tqdm=False), llm.embed([ids], use_tqdm=False)
    assert first[0].n_cached_tokens == 0 and again[0].n_cached_tokens > 0
    reference = reference_embedding(zoo.reference("qwen2"), ids, "last")
    assert_close(first[0].embedding, reference)
    assert_close(again[0].embedding, reference)
    mean = llm.embed([ids], pooling="mean", use_tqdm=False)[0]
    assert mean.n_cached_tokens == 0  # mean pooling reads every token's state: nothing is reused
    assert_close(mean.embedding, reference_embedding(zoo.reference("qwen2"), ids, "mean"))


def test_dimensions_keep_the_first_values_normalized_again(zoo):
    model = zoo.ours("llama-llama3", "gguf")
    llm = LLM(model, n_ctx=256, max_num_seqs=2)
    ids = token_ids(model.config.vocab_size, 12, seed=5)
    whole = reference_embedding(zoo.reference("llama-llama3"), ids, "last")
    short = llm.embed([ids], dimensions=16, use_tqdm=False)[0].embedding
    assert_close(short, whole[:16] / whole[:16].norm())
    for bad in (0, model.config.n_embd + 1):
        with pytest.raises(ValueError, match=f"between 1 and {model.config.n_embd} .*, got {bad}"):
            llm.embed([ids], dimensions=bad, use_tqdm=False)
    assert truncated(short, 16) == short
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls, got 'max'"):
        llm.embed([ids], pooling="max", use_tqdm=False)


def test_the_models_pooling_comes_from_its_file(zoo, tmp_path):
    """A GGUF's {arch}.pooling_type (llama.cpp's numbering: 1 mean, 2 cls, 3 last) and a sentence-transformers
    folder's 1_Pooling/config.json; "last" where neither says."""
    folder = tmp_path / "mean-pooled"
    shutil.copytree(zoo.path("qwen2", "hf-new"), folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                                  "pooling_mode_lasttoken": False}))
    assert load_model(str(folder), "float32", progress=False).config.pooling == "mean"
    assert zoo.ours("qwen2", "hf-new").config.pooling == zoo.ours("qwen2", "gguf").config.pooling == "last"
    path = zoo.path("qwen2", "gguf")
    metadata = GGUFFile(path).metadata
    for value, pooling in ((1, "mean"), (2, "cls"), (3, "last"), (0, "last")):
        config = config_from_metadata({**metadata, "qwen2.pooling_type": value}, path, tied=True)
        assert config.pooling == pooling


@pytest.mark.server
def test_the_embeddings_endpoint_answers_as_transformers(zoo):
    """POST /v1/embeddings through the official client: floats and base64 alike, dimensions, and bad input refused
    with the field named while the server goes on serving."""
    import openai

    from helpers.server import serving
    from kvlm.server.app import create_app

    model = zoo.ours("qwen3", "gguf")
    reference = zoo.reference("qwen3")
    batch = prompts(model.config.vocab_size)
    with serving(create_app(Engine(model, n_ctx=256, max_num_seqs=4, max_num_batched_tokens=32), "embedder")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        floats = client.embeddings.create(model="embedder", input=batch)
        assert floats.usage.prompt_tokens == sum(LENGTHS) and [d.index for d in floats.data] == [0, 1, 2, 3]
        for ids, item in zip(batch, floats.data):
            assert_close(item.embedding, reference_embedding(reference, ids, "last"))
        encoded = client.embeddings.create(model="embedder", input=batch[2], encoding_format="base64")
        decoded = np.frombuffer(base64.b64decode(encoded.data[0].embedding), dtype="<f4")
        assert decoded.tolist() == torch.tensor(floats.data[2].embedding, dtype=torch.float32).tolist()
        short = client.embeddings.create(model="embedder", input=[batch[2]], dimensions=8).data[0].embedding
        whole = reference_embedding(reference, batch[2], "last")
        assert_close(short, whole[:8] / whole[:8].norm())
        for bad, param in (({"input": batch[2], "dimensions": 0}, "dimensions"), ({"input": []}, "input"),
                           ({"input": [[model.config.vocab_size]]}, "input[0]"),
                           ({"input": [list(range(300))]}, "input[0]")):
            with pytest.raises(openai.BadRequestError) as caught:
                client.embeddings.create(model="embedder", **bad)
            assert caught.value.body["param"] == param
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model="another", input="x")
        assert_close(client.embeddings.create(model="embedder", input=batch[0]).data[0].embedding,
                     reference_embedding(reference, batch[0], "last"))


def test_a_preempted_embedding_request_pools_its_prompt_once(zoo):
    """Preempted mid-prompt (a request of higher priority takes its sequence), it is computed again from the start;
    its mean is still over its prompt's tokens once."""
    model, name = zoo.ours("qwen2", "gguf"), "qwen2"
    engine = Engine(model, n_ctx=256, max_num_seqs=1, max_num_batched_tokens=16, scheduling_policy="priority")
    prompt = token_ids(model.config.vocab_size, 60, seed=11)
    embedding = engine.add_request(prompt, SamplingParams(max_tokens=1), pooling="mean", priority=5)
    engine.step(), engine.step()  # 32 of its 60 tokens computed
    assert engine.requests[embedding].n_computed == 32
    engine.add_request(prompt[:5], SamplingParams(temperature=0, max_tokens=4), priority=0)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[embedding].n_preemptions == 1
    assert_close(engine.release(embedding).embedding, reference_embedding(zoo.reference(name), prompt, "mean"))


def test_embedding_requests_leave_nothing_in_the_prefix_tiers(zoo):
    """An embedded text is no conversation to come back to: the RAM tier keeps generating requests' states only."""
    model = zoo.ours("qwen2", "gguf")
    llm = LLM(model, n_ctx=256, max_num_seqs=2, prefix_cache_ram="16MiB")
    ids = token_ids(model.config.vocab_size, 40, seed=4)
    llm.embed([ids], use_tqdm=False)
    assert [len(tier.entries) for tier in llm.engine.tiers.tiers] == [0]
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [len(tier.entries) for tier in llm.engine.tiers.tiers] == [1]
