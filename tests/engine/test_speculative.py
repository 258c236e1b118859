"""Speculative decoding: guesses verified in the engine's step change nothing but the speed.

On random-weight models of every family and memory kind (transformers builds them; weights requantized to Q8_0 so
the native kernels compute them, whose rows do not depend on the rows beside them; without those kernels, the
batch-invariant float32 mode): greedy and seeded sampled
output with prompt lookup and with a draft model equals the output without, alone and beside other requests and
across micro-batch cuts; a model drafting for itself accepts every guess; the memory after every step is that of a
run that only saw the committed tokens; stop strings, max_tokens and the end of the context cut where they would.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.speculative import NGRAM, REPEATING, _random_gguf, exact_model, oracle_guesses
from kvlm import LLM, Batch, Context, SamplingParams, load_model
import kvlm.speculative.speculator as speculator_module
from kvlm.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

# unified x3, iSWA (one row size; two, and shared K/V), hybrid (short convolutions; delta rule), recurrent
FAMILIES = ["llama-llama3", "qwen2", "qwen3", "gemma3", "gemma4", "lfm2", "qwen35", "mamba2"]
RECURRENT = ("lfm2", "qwen35", "mamba2")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target(family, tmp_path_factory):
    return exact_model(_random_gguf(family, tmp_path_factory.mktemp(family)))


@pytest.fixture(scope="module")
def draft(family, tmp_path_factory):
    path = _random_gguf(family, tmp_path_factory.mktemp(f"{family}-draft"), perturbed=True)
    return exact_model(path)


def _generate(model, prompts, params, speculative=None, **engine):
    llm = LLM(model, n_ctx=256, max_num_seqs=4, speculative_config=speculative, **engine)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


def _prompts(vocab: int) -> list[list[int]]:
    generator = np.random.default_rng(3)
    return [REPEATING, [1, *generator.integers(3, vocab, 20).tolist()] * 3, [1, 40, 41, 42, 43] * 4]


def test_greedy_output_is_unchanged_whatever_is_accepted(target, monkeypatch):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _prompts(target.config.vocab_size)
    expected, _ = _generate(target, prompts, params)
    monkeypatch.setattr(speculator_module, "propose_ngram", oracle_guesses(prompts, expected, target.config.vocab_size))
    together, llm = _generate(target, prompts, params, NGRAM)
    assert together == expected
    accepted = llm.engine.speculator.stats.accepted_per_pos
    assert all(n > 0 for n in accepted) and sum(accepted) < llm.engine.speculator.stats.num_draft_tokens
    alone = [_generate(target, [prompt], params, NGRAM)[0][0] for prompt in prompts[:2]]
    assert alone == expected[:2]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_unchanged_with_each_proposer(target, draft, method):
    speculative = NGRAM if method == "ngram" else {"model": draft, "num_speculative_tokens": 3, "adaptive": False}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _prompts(target.config.vocab_size)
    expected, _ = _generate(target, prompts, params)
    together, llm = _generate(target, prompts, params, speculative)
    assert together == expected
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_seeded_sampling_is_unchanged(target):
    params = [SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
              for seed in (1, 2, 3)]
    prompts = _prompts(target.config.vocab_size)
    expected, _ = _generate(target, prompts, params)
    assert _generate(target, prompts, params, NGRAM)[0] == expected


def test_micro_batch_cuts_change_nothing(target):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts(target.config.vocab_size)
    expected, _ = _generate(target, prompts, params)
    cut, _ = _generate(target, prompts, params, NGRAM, max_num_batched_tokens=16)
    assert cut == expected


def test_a_model_drafting_for_itself_accepts_every_guess(target):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    speculative = {"model": target, "num_speculative_tokens": 4, "adaptive": False}
    prompts = _prompts(target.config.vocab_size)[:2]
    outputs, llm = _generate(target, prompts, params, speculative)
    assert outputs == _generate(target, prompts, params)[0]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_memory_after_every_step_is_that_of_the_committed_tokens(target, family):
    """Step by step: the sequence's positions and its K/V rows (or recurrent state) equal those of a context that
    decoded the committed tokens one by one."""
    engine = Engine(target, n_ctx=256, max_num_seqs=2, enable_prefix_caching=False, speculative_config=NGRAM)
    request_id = engine.add_request(REPEATING, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    request = engine.requests[request_id]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if request.finished or not request.output_token_ids:
            continue
        committed = request.token_ids[: request.n_computed]
        memory = engine.context.memory
        assert memory.seq_pos_max(request.seq_id) == len(committed) - 1
        reference = Context(target, n_ctx=256, n_seq_max=2, kv_dtype=engine.context.kv_dtype)
        reference.decode(Batch(tokens=REPEATING, seq_ids=[0] * len(REPEATING)))
        for position in range(len(REPEATING), len(committed)):
            reference.decode(Batch(tokens=[committed[position]], pos=[position], seq_ids=[0]))
        _assert_same_sequence(memory, request.seq_id, reference.memory, 0, exact=family not in RECURRENT)
        checked += 1
    assert checked > 5


def _assert_same_sequence(memory, seq_id, reference, reference_seq, exact: bool) -> None:
    """Every position the sequence's next token may read (all of them, or its sliding window) is held, with the
    same K/V bytes, and nothing past its committed tokens is."""
    n_committed = memory.seq_pos_max(seq_id) + 1
    for pool, theirs in zip(memory.pools, reference.pools):
        ours_cells, their_cells = _cells_by_position(pool, seq_id), _cells_by_position(theirs, reference_seq)
        needed = [p for p in their_cells if not pool.window or p >= n_committed - pool.window]
        assert max(ours_cells) == n_committed - 1 and set(needed) <= set(ours_cells)
        for layer in range(pool.store.n_layer):
            for plane, their_plane in ((pool.store.k, theirs.store.k), (pool.store.v, theirs.store.v)):
                a = plane.data[layer][[ours_cells[p] for p in needed]]
                b = their_plane.data[layer][[their_cells[p] for p in needed]]
                assert torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), atol=1e-4)
    states = getattr(memory, "recurrent", memory if memory.kind == "recurrent" else None)
    if states is not None:
        theirs = getattr(reference, "recurrent", reference)
        span, parts = states.state_parts(seq_id)
        their_span, their_parts = theirs.state_parts(reference_seq)
        assert span == their_span
        for a, b in zip(parts, their_parts):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _cells_by_position(pool, seq_id) -> dict[int, int]:
    """Position -> cell of the sequence's cells in a pool."""
    cells = pool.cells
    return dict(sorted((int(cells.pos[c]), int(c)) for c in cells.seq_cells(seq_id)))


def test_long_prompts_in_chunks_beside_guesses_in_the_batch_invariant_mode(tmp_path):
    """Prompts longer than a chunk are cut where the budget left by other requests ends, and guesses end requests
    sooner, so chunk boundaries move; the batch-invariant mode's logits do not depend on them: the same output."""
    model = load_model(str(_random_gguf("qwen2", tmp_path)), "float32", batch_invariant=True, progress=False)
    generator = np.random.default_rng(4)
    prompts = [[1, *generator.integers(3, 1000, 30).tolist()] * 3 for _ in range(4)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 30, 12, 40)]
    expected, _ = _generate(model, prompts, params, max_num_batched_tokens=24)
    got, llm = _generate(model, prompts, params, NGRAM, max_num_batched_tokens=24)
    assert got == expected and llm.engine.speculator.stats.num_draft_tokens > 0


def test_a_draft_that_cannot_run_guesses_nothing_and_loses_nothing(monkeypatch):
    """A draft step that fails (its memory full) mid-proposal: no guesses this step, the draft's sequences back as
    they were, the output as without speculation."""
    import tempfile
    from pathlib import Path

    from kvlm.speculative.draft_model import DraftModel

    with tempfile.TemporaryDirectory() as folder:
        model = exact_model(_random_gguf("llama-llama3", Path(folder)))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected, _ = _generate(model, [REPEATING], params)
    original, calls = DraftModel._decode, []

    def every_third_fails(self, tokens, positions, seq_ids, outputs):
        calls.append(len(tokens))
        if len(calls) % 3 == 0:
            from kvlm.speculative.draft_model import DraftError
            raise DraftError("no room")
        return original(self, tokens, positions, seq_ids, outputs)

    monkeypatch.setattr(DraftModel, "_decode", every_third_fails)
    got, llm = _generate(model, [REPEATING], params, {"model": model, "num_speculative_tokens": 3, "adaptive": False})
    assert got == expected
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens  # it drafts for itself
