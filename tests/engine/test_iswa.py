"""The iSWA memory kind on a random Gemma 3 that transformers builds (window 8): a full pool for the full-attention
layer, a small sliding pool whose cells are freed as the windows move on, against transformers and against the
same model with every cell kept (swa_full)."""
from __future__ import annotations

import pytest
import torch

from helpers.gemma3_factory import WINDOW, random_gemma3
from helpers.gguf_factory import save_hf_folder
from helpers.models import assert_same_state, decode_ok, max_diff, one_batch, pool_state, reference_logits, token_ids
from kvlm import LLM, Batch, Context, DecodeStatus, SamplingParams, load_model
from kvlm.core.errors import CacheError
from kvlm.memory.iswa import ISWAMemory
from kvlm.memory.kv_store import BYTES_PER_ELEMENT
from kvlm.memory.seq_state import StateError

TOLERANCE = 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference():
    return random_gemma3()


@pytest.fixture(scope="module")
def ours(reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-iswa")
    save_hf_folder(reference, folder)
    return load_model(str(folder), "float32")


def iswa_context(model, n_seq_max=1, n_ubatch=7, **kwargs) -> Context:
    ctx = Context(model, n_ctx=kwargs.pop("n_ctx", 256), n_batch=kwargs.pop("n_batch", 256), n_ubatch=n_ubatch,
                  n_seq_max=n_seq_max, **kwargs)
    assert isinstance(ctx.memory, ISWAMemory)
    return ctx


def test_pools_are_sized_as_llama_cpp_and_their_bytes_add_up(ours):
    config = ours.config
    ctx = iswa_context(ours, n_seq_max=3, n_ubatch=7, kv_dtype="f16")
    full, sliding = ctx.memory.pools
    assert (full.n_cells, sliding.n_cells) == (256, WINDOW * 3 + 7)
    assert (full.store.n_layer, sliding.store.n_layer) == (1, 6)
    row = 2 * config.n_head_kv * config.head_dim * BYTES_PER_ELEMENT["f16"]  # K and V of one cell, one layer
    assert ctx.memory.kv_bytes == row * (1 * 256 + 6 * (WINDOW * 3 + 7))
    kept = Context(ours, n_ctx=256, n_ubatch=7, n_seq_max=3, kv_dtype="f16", swa_full=True).memory
    assert kept.kind == "unified" and kept.kv_bytes == row * 7 * 256


def test_cells_leave_the_sliding_pool_as_decoding_goes_on(ours, reference):
    """A 40-token prompt in micro-batches of 7, then 20 tokens one at a time: after each step the sliding pool
    holds only the last WINDOW positions, the full pool all of them, and the logits are transformers'."""
    ids = token_ids(1000, 60, seed=21)
    expected = reference_logits(reference, ids)
    ctx = iswa_context(ours)
    decode_ok(ctx, Batch.for_sequence(ids[:40]))
    assert max_diff(ctx.get_logits_ith(-1), expected[39]) <= TOLERANCE
    full, sliding = ctx.memory.pools
    for step, token in enumerate(ids[40:], start=40):
        decode_ok(ctx, Batch.for_sequence([token]))
        assert max_diff(ctx.get_logits_ith(-1), expected[step]) <= TOLERANCE
        assert full.n_used == step + 1
        assert sliding.n_used == WINDOW
        assert ctx.memory.seq_pos_min(0) == step - WINDOW + 1 and ctx.memory.seq_pos_max(0) == step
    assert sliding.n_cells == WINDOW + 7  # 60 positions went through 15 cells


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
def test_several_sequences_in_straddling_micro_batches_equal_every_cell_kept(ours, reference, kv_dtype):
    """Three sequences of different lengths in one batch cut into micro-batches of 7, then 12 decode steps of all
    three: the iSWA pools give the logits of the same model with every cell kept (and, in f32, transformers')."""
    prompts = [token_ids(1000, n, seed=n) for n in (30, 5, 17)]
    runs = [iswa_context(ours, n_seq_max=3, kv_dtype=kv_dtype),
            Context(ours, n_ctx=256, n_ubatch=7, n_seq_max=3, kv_dtype=kv_dtype, swa_full=True)]
    for ctx in runs:
        decode_ok(ctx, one_batch(prompts))
    tolerance = TOLERANCE if kv_dtype == "f32" else 0.05
    for step in range(12):
        logits = [torch.stack([ctx.get_logits_ith(i) for i in range(3)]) for ctx in runs]
        assert max_diff(logits[0], logits[1]) <= tolerance
        if kv_dtype == "f32":
            for i, ids in enumerate(prompts):
                assert max_diff(logits[0][i], reference_logits(reference, ids)[-1]) <= TOLERANCE
        for i in range(3):
            prompts[i].append(int(logits[1][i].argmax()))
        batch = Batch(tokens=[p[-1] for p in prompts], seq_ids=[0, 1, 2], logits=[True] * 3)
        for ctx in runs:
            decode_ok(ctx, batch)
    assert runs[0].memory.sliding.n_used <= 3 * WINDOW


def test_a_failed_batch_restores_cells_and_the_rows_it_took_over(ours, reference, monkeypatch, fail_forward_at):
    """The third micro-batch fails after the first two reused cells that held the sequence's window before the
    batch: both pools' bookkeeping and K/V bytes come back exactly, and the batch then runs as if never tried."""
    ids = token_ids(1000, 41, seed=22)
    ctx = iswa_context(ours)
    decode_ok(ctx, Batch.for_sequence(ids[:20]))
    before = pool_state(ctx)
    fail_forward_at(ours.decoder, 3)
    assert ctx.decode(Batch.for_sequence(ids[20:41])) == DecodeStatus.COMPUTE_FAILED
    assert_same_state(pool_state(ctx), before)
    monkeypatch.undo()
    decode_ok(ctx, Batch.for_sequence(ids[20:41]))
    assert max_diff(ctx.get_logits_ith(-1), reference_logits(reference, ids)[-1]) <= TOLERANCE


def test_seq_rm_into_freed_cells_answers_false_and_changes_nothing(ours, reference):
    ids = token_ids(1000, 40, seed=23)
    ctx = iswa_context(ours)
    decode_ok(ctx, Batch.for_sequence(ids[:30]))
    before = pool_state(ctx)
    assert ctx.memory.seq_rm(0, 10, -1) is False  # position 10's window reaches cells freed long ago
    assert_same_state(pool_state(ctx), before)
    assert ctx.memory.seq_rm(0, 28, -1) is True  # the last micro-batch: its window is still whole
    decode_ok(ctx, Batch.for_sequence(ids[28:40]))
    assert max_diff(ctx.get_logits_ith(-1), reference_logits(reference, ids)[-1]) <= TOLERANCE


def test_copying_an_old_prefix_or_shifting_freed_cells_into_view_is_refused(ours):
    ctx = iswa_context(ours, n_seq_max=2)
    decode_ok(ctx, Batch.for_sequence(token_ids(1000, 30, seed=24)))
    before = pool_state(ctx)
    with pytest.raises(CacheError, match=r"sequence 1 would need position 5 in its sliding window \(8\)"):
        ctx.memory.seq_cp(0, 1, 0, 12)  # sequence 1 would continue at 12: its window 5..11 was freed
    assert_same_state(pool_state(ctx), before)
    assert ctx.memory.seq_rm(0, 3, 26) is True  # 0..2 and 26..29 stay; 30's window is 26..29: whole
    before = pool_state(ctx)
    with pytest.raises(CacheError, match="was freed"):
        ctx.memory.seq_add(0, 26, -1, -23)  # 26..29 become 3..6: the next window would reach 0..2, freed
    assert_same_state(pool_state(ctx), before)


def test_shifted_positions_rotate_each_pool_with_its_own_base(ours, reference):
    """seq_add moves the whole sequence by 5: the full pool re-rotates with the global RoPE, the sliding pool with
    the local one, and the next tokens get transformers' logits at the moved positions."""
    ids = token_ids(1000, 50, seed=25)
    ctx = iswa_context(ours)
    decode_ok(ctx, Batch.for_sequence(ids[:40]))
    ctx.memory.seq_add(0, 0, 40, 5)
    decode_ok(ctx, Batch.for_sequence(ids[40:], start_pos=45))
    with torch.no_grad():
        expected = reference(torch.tensor([ids]), position_ids=torch.arange(5, 55)[None]).logits[0, -1]
    assert max_diff(ctx.get_logits_ith(-1), expected) <= TOLERANCE


def test_context_shift_equals_the_same_shift_with_every_cell_kept(ours):
    """llama.cpp's context shift (keep 4, discard 20, move the rest down), then 10 more tokens: as with swa_full."""
    ids = token_ids(1000, 50, seed=31)
    runs = [iswa_context(ours), Context(ours, n_ctx=256, n_ubatch=7, swa_full=True)]
    for ctx in runs:
        decode_ok(ctx, Batch.for_sequence(ids[:40]))
        assert ctx.memory.seq_rm(0, 4, 24) is True
        ctx.memory.seq_add(0, 24, -1, -20)
        decode_ok(ctx, Batch.for_sequence(ids[40:50]))
    assert max_diff(runs[0].get_logits_ith(-1), runs[1].get_logits_ith(-1)) <= TOLERANCE


def test_a_saved_sequence_restores_both_pools_into_another_context(ours, reference):
    ids = token_ids(1000, 45, seed=26)
    source = iswa_context(ours)
    decode_ok(source, Batch.for_sequence(ids[:33]))
    blob = source.state_seq_save(0)
    target = iswa_context(ours, n_seq_max=2)
    target.state_seq_load(blob, 1)
    full, sliding = target.memory.pools
    assert (full.cells.seq_positions(1).tolist(), sorted(sliding.cells.seq_positions(1).tolist())) == \
        (list(range(33)), list(range(21, 33)))  # pruned to 28's window when its micro-batch (28..32) began
    decode_ok(target, Batch.for_sequence(ids[33:], seq_id=1))
    assert max_diff(target.get_logits_ith(-1), reference_logits(reference, ids)[-1]) <= TOLERANCE
    assert target.state_seq_save(1) != blob
    kept = Context(ours, n_ctx=256, n_ubatch=7, swa_full=True)
    before = pool_state(kept)
    with pytest.raises(StateError, match="pools"):
        kept.state_seq_load(blob, 0)
    assert_same_state(pool_state(kept), before)


# --- the engine: prefix reuse where the windows are whole, recompute where they are not ---

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine(model, **kwargs) -> LLM:
    return LLM(model, n_ctx=256, max_num_seqs=2, max_num_batched_tokens=16, **kwargs)


def run(llm: LLM, prompt: list[int]):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def test_engine_reuses_a_prefix_only_where_its_window_is_whole(ours):
    """A shares 40 tokens with B, but A's prompt ran on past them in chunks of 16, so the window before any block
    end B could borrow was freed: B is computed in full. C extends A's whole conversation: it borrows it. With
    swa_full every cell stays and B borrows too. Every output equals the run without prefix caching."""
    shared = token_ids(1000, 40, seed=27)
    a = shared + token_ids(1000, 30, seed=28)
    b = shared + token_ids(1000, 5, seed=29)
    llm = engine(ours)
    assert llm.engine.context.memory.sliding.n_cells == (WINDOW + 15) * 3 + 16  # a block (16) - 1 kept extra
    out_a = run(llm, a)
    c = a + out_a.token_ids + token_ids(1000, 6, seed=30)
    out_b, out_c = run(llm, b), run(llm, c)
    assert out_b.n_cached_tokens == 0
    assert out_c.n_cached_tokens >= len(a) + len(out_a.token_ids) - 16
    kept = engine(ours, swa_full=True)
    run(kept, a)
    kept_b = run(kept, b)
    assert kept_b.n_cached_tokens == 32
    plain = engine(ours, enable_prefix_caching=False)
    for prompt, output in ((a, out_a), (b, out_b), (c, out_c), (b, kept_b)):
        assert output.token_ids == run(plain, prompt).token_ids


def test_engine_with_a_small_memory_preempts_and_recomputes(ours):
    """Six requests, 3 at a time, in a 128-cell context (a 108-cell sliding pool): preemption happens, and each
    output equals its own run."""
    prompts = [token_ids(1000, 30 + 3 * i, seed=40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(ours, n_ctx=128, max_num_seqs=3, max_num_batched_tokens=16)
    assert llm.engine.context.memory.sliding.n_cells == 108
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.n_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        alone = LLM(ours, n_ctx=128, max_num_seqs=1, enable_prefix_caching=False)
        assert output.token_ids == alone.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_compaction_closes_the_holes_of_both_pools_and_changes_no_result(ours):
    prompts = [token_ids(1000, n, seed=50 + n) for n in (25, 18, 30)]
    runs = [iswa_context(ours, n_seq_max=3) for _ in range(2)]
    for ctx in runs:
        decode_ok(ctx, one_batch(prompts))
        assert ctx.memory.seq_rm(1, -1, -1) is True
    runs[0].memory.compact()
    for pool in runs[0].memory.pools:
        assert pool.cells.used_max == pool.n_used
    batch = Batch(tokens=[7, 9], seq_ids=[0, 2], logits=[True, True])
    for ctx in runs:
        decode_ok(ctx, batch)
    assert max_diff(runs[0].get_logits_ith(0), runs[1].get_logits_ith(0)) <= TOLERANCE
    assert max_diff(runs[0].get_logits_ith(1), runs[1].get_logits_ith(1)) <= TOLERANCE
