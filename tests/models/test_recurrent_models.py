"""Recurrent models against transformers on random-weight models it builds: LFM2 (short-convolution layers, i.e.
recurrent state slots, interleaved with GQA attention layers, a KV cache: the hybrid memory), Qwen3.5 (Gated
DeltaNet layers, three for every gated attention layer: the hybrid memory too; tests/helpers/qwen35_factory.py) and
Mamba2 (every layer a Mamba2 mixer: the recurrent memory alone). Each from a transformers folder and from a GGUF
written as llama.cpp's converter writes it (tensor names from the gguf package's own map)."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from helpers.gguf_factory import save_hf_folder
from helpers.models import decode_ok, max_diff, reference_logits, token_ids
from helpers.qwen35_factory import random_qwen35, write_qwen35_gguf
from helpers.recurrent_factory import lfm2_gguf, mamba2_gguf, random_lfm2, random_mamba2
from kvlm import LLM, Batch, Context, DecodeStatus, SamplingParams, load_model
from kvlm.core.errors import CacheError
from kvlm.memory.hybrid import HybridMemory
from kvlm.memory.recurrent import RecurrentMemory

TOLERANCE = 1e-4

# reference set here: transformers builds these models in helpers.recurrent_factory, so this module's text (what
# conftest reads) no longer imports it
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.reference]


FAMILIES = {"lfm2": (random_lfm2, lfm2_gguf, HybridMemory), "mamba2": (random_mamba2, mamba2_gguf, RecurrentMemory),
            "qwen35": (random_qwen35, lambda model, path: write_qwen35_gguf(model, path / "model.gguf"), HybridMemory)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(family):
    return FAMILIES[family][0]()


@pytest.fixture(scope="module", params=["hf", "gguf"])
def ours(request, family, reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"{family}-{request.param}")
    if request.param == "gguf":
        return load_model(str(FAMILIES[family][1](reference, folder)), "float32")
    save_hf_folder(reference, folder)
    return load_model(str(folder), "float32")


def test_config_reads_the_layer_kinds(ours, family):
    if family == "lfm2":
        assert ours.config.layer_kinds == ("conv", "conv", "attention", "conv", "attention", "conv")
        assert ours.config.conv_kernel == 3 and ours.config.n_head_kv == 2
    elif family == "qwen35":
        assert ours.config.layer_kinds == (("gated_delta",) * 3 + ("attention",)) * 2
    else:
        assert ours.config.layer_kinds == ("mamba",) * 3
        assert (ours.config.n_head, ours.config.head_dim, ours.config.ssm_state, ours.config.ssm_groups) == (8, 16, 16, 2)


@pytest.mark.parametrize("n_prompt", [10, 300])
def test_logits_equal_transformers(ours, reference, family, n_prompt):
    ids = token_ids(1000, n_prompt, seed=n_prompt)
    ctx = Context(ours, n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=1)
    assert isinstance(ctx.memory, FAMILIES[family][2])
    decode_ok(ctx, Batch(tokens=ids, logits=[True] * n_prompt))
    logits = torch.stack([ctx.get_logits_ith(i) for i in range(n_prompt)])
    assert max_diff(logits, reference_logits(reference, ids)) <= TOLERANCE


@pytest.mark.parametrize("n_prompt", [10, 300])
def test_greedy_32_tokens_equal_transformers(ours, reference, n_prompt):
    prompt = token_ids(1000, n_prompt, seed=100 + n_prompt)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                      min_new_tokens=32)[0, n_prompt:].tolist()
    ctx = Context(ours, n_ctx=512, n_ubatch=64, n_seq_max=1)
    decode_ok(ctx, Batch.for_sequence(prompt))
    generated = []
    for _ in range(32):
        generated.append(int(ctx.get_logits_ith(-1).argmax()))
        decode_ok(ctx, Batch.for_sequence(generated[-1:]))
    assert generated == expected


@pytest.mark.parametrize("n_ubatch", [1, 7])
def test_several_sequences_in_micro_batches_equal_each_alone(ours, reference, n_ubatch):
    """Three prompts of different lengths in one batch, cut into micro-batches of 1 or 7 with the same number of
    tokens per sequence; then 4 decode steps of all three. Each equals transformers on that sequence alone."""
    prompts = [token_ids(1000, n, seed=200 + n) for n in (23, 9, 16)]
    ctx = Context(ours, n_ctx=256, n_ubatch=n_ubatch, n_seq_max=3)
    tokens = [t for p in prompts for t in p]
    seq_ids = [s for s, p in enumerate(prompts) for _ in p]
    outputs = [i for i in range(len(tokens)) if i + 1 == len(tokens) or seq_ids[i + 1] != seq_ids[i]]
    decode_ok(ctx, Batch(tokens=tokens, seq_ids=seq_ids, logits=[i in outputs for i in range(len(tokens))]))
    for step in range(5):
        for s, prompt in enumerate(prompts):
            assert max_diff(ctx.get_logits_ith(s), reference_logits(reference, prompt)[-1]) <= TOLERANCE
        if step < 4:
            nxt = [int(ctx.get_logits_ith(s).argmax()) for s in range(3)]
            for s in range(3):
                prompts[s].append(nxt[s])
            decode_ok(ctx, Batch(tokens=nxt, seq_ids=[0, 1, 2], logits=[True] * 3))


def test_seq_cp_then_diverging_continuations(ours, reference):
    prompt = token_ids(1000, 20, seed=300)
    ctx = Context(ours, n_ctx=128, n_ubatch=8, n_seq_max=2)
    decode_ok(ctx, Batch.for_sequence(prompt))
    ctx.memory.seq_cp(0, 1, -1, -1)
    decode_ok(ctx, Batch(tokens=[5, 6, 7, 8], seq_ids=[0, 0, 1, 1], logits=[False, True, False, True]))
    assert max_diff(ctx.get_logits_ith(0), reference_logits(reference, prompt + [5, 6])[-1]) <= TOLERANCE
    assert max_diff(ctx.get_logits_ith(1), reference_logits(reference, prompt + [7, 8])[-1]) <= TOLERANCE


def memory_snapshot(ctx: Context) -> list:
    """The recurrent slots' bookkeeping and committed states; for a hybrid memory also its cells and their K/V
    rows."""
    memory = ctx.memory
    recurrent = memory.recurrent if isinstance(memory, HybridMemory) else memory
    committed = [s.clone() for slot in range(recurrent.n_seq_max) for layer in recurrent.committed(slot) for s in layer]
    snapshot = [recurrent.first.copy(), recurrent.last.copy(), recurrent.current.copy(), recurrent.written.copy(),
                *committed]
    for pool in memory.pools:
        used = torch.from_numpy(np.flatnonzero(pool.cells.pos >= 0))
        snapshot += [pool.cells.pos.copy(), pool.cells.seqs.copy(), pool.store.k.data[:, used].clone(),
                     pool.store.v.data[:, used].clone()]
    return snapshot


def assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else torch.equal(x, y)


def test_partial_removal_and_shifts_are_refused_and_change_nothing(ours):
    ctx = Context(ours, n_ctx=128, n_ubatch=8, n_seq_max=2)
    decode_ok(ctx, Batch.for_sequence(token_ids(1000, 20, seed=301)))
    before = memory_snapshot(ctx)
    assert ctx.memory.seq_rm(0, 10, -1) is False  # a state cannot forget its last tokens
    assert ctx.memory.seq_rm(0, 0, 10) is False
    with pytest.raises(CacheError, match="context shift"):
        ctx.memory.seq_add(0, 0, -1, -5)
    with pytest.raises(CacheError, match="in part"):
        ctx.memory.seq_cp(0, 1, 0, 10)
    assert_same(memory_snapshot(ctx), before)
    assert ctx.memory.seq_rm(0, 25, -1) is True  # nothing there: nothing to do
    assert ctx.memory.seq_rm(0, -1, -1) is True and ctx.memory.seq_pos_max(0) == -1
    assert ctx.memory.n_used == 0 and ctx.memory.seq_pos_min(0) == -1


def test_a_token_of_two_sequences_is_an_invalid_batch(ours):
    ctx = Context(ours, n_ctx=128, n_seq_max=2)
    status = ctx.decode(Batch(tokens=[5, 6], seq_ids=[[0, 1], [0, 1]]))
    assert status == DecodeStatus.INVALID_BATCH and "one sequence only" in ctx.last_error
    assert ctx.memory.n_used == 0


def test_a_failed_batch_restores_every_state_it_touched(ours, reference, monkeypatch, fail_forward_at):
    prompts = [token_ids(1000, 12, seed=302), token_ids(1000, 15, seed=303)]
    ctx = Context(ours, n_ctx=128, n_ubatch=4, n_seq_max=2)
    decode_ok(ctx, Batch(tokens=prompts[0] + prompts[1], seq_ids=[0] * 12 + [1] * 15))
    before = memory_snapshot(ctx)
    fail_forward_at(ours.decoder, 3)
    more = [token_ids(1000, 6, seed=304), token_ids(1000, 6, seed=305)]
    batch = Batch(tokens=more[0] + more[1], seq_ids=[0] * 6 + [1] * 6, logits=[False] * 5 + [True] + [False] * 5 + [True])
    assert ctx.decode(batch) == DecodeStatus.COMPUTE_FAILED
    assert_same(memory_snapshot(ctx), before)
    monkeypatch.undo()
    decode_ok(ctx, batch)
    for s in range(2):
        assert max_diff(ctx.get_logits_ith(s), reference_logits(reference, prompts[s] + more[s])[-1]) <= TOLERANCE


def test_a_saved_state_restores_into_another_sequence(ours, reference):
    prompt = token_ids(1000, 30, seed=306)
    source = Context(ours, n_ctx=128, n_ubatch=16, n_seq_max=1)
    decode_ok(source, Batch.for_sequence(prompt[:25]))
    blob = source.state_seq_save(0)
    target = Context(ours, n_ctx=128, n_ubatch=16, n_seq_max=3)
    decode_ok(target, Batch.for_sequence(token_ids(1000, 7, seed=307), seq_id=0))
    target.state_seq_load(blob, 2)
    decode_ok(target, Batch.for_sequence(prompt[25:], seq_id=2))
    assert max_diff(target.get_logits_ith(-1), reference_logits(reference, prompt)[-1]) <= TOLERANCE
    with pytest.raises(CacheError, match="not empty"):
        target.state_seq_load(blob, 2)


def test_engine_preempts_and_recomputes_with_the_outputs_of_each_request_alone(ours, family):
    """Five requests, three at a time, in 96 cells: LFM2's and Qwen3.5's KV cells run out and a request is
    preempted, then recomputed; Mamba2 needs one state slot per running request whatever its length, so nothing is preempted.
    Either way each output equals its request run alone."""
    prompts = [token_ids(1000, 20 + 5 * i, seed=400 + i) for i in range(5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(ours, n_ctx=96, max_num_seqs=3, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert (llm.engine.scheduler.n_preemptions > 0) == (family in ("lfm2", "qwen35"))
    for prompt, output in zip(prompts, outputs):
        alone = LLM(ours, n_ctx=96, max_num_seqs=1).generate([prompt], params, use_tqdm=False)[0]
        assert output.token_ids == alone.token_ids
