"""Context.decode on the real SmolLM2: many sequences, micro-batches, rollback, shift, compaction, state."""
from __future__ import annotations

import re

import pytest
import torch

from helpers.models import decode_ok, memory_state, one_batch, single_sequence_context
from kvlm import Batch, Context, DecodeStatus
from kvlm.core.errors import CacheError

TOLERANCE = 1e-4
PROMPTS = ["The capital of France is", "def square(x):\n    return", "Rain falls when", "My favourite colour is"]


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [smollm2.tokenizer.encode(p) for p in PROMPTS]


def new_context(model, **kwargs) -> Context:
    return Context(model, **{"n_ctx": 256, "n_batch": 256, "n_ubatch": 64, "n_seq_max": 8, **kwargs})


def greedy_alone(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    ctx = new_context(model)
    decode_ok(ctx, Batch.for_sequence(ids))
    tokens, logits = [], [ctx.get_logits_ith(-1).clone()]
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        decode_ok(ctx, Batch.for_sequence([tokens[-1]]))
        logits.append(ctx.get_logits_ith(-1).clone())
    return tokens, logits


def test_sequences_in_one_batch_match_each_alone_and_transformers(smollm2, hf_smollm2, prompts):
    steps = 6
    alone = [greedy_alone(smollm2, ids, steps) for ids in prompts]
    ctx = new_context(smollm2)
    decode_ok(ctx, one_batch(prompts))
    generated = [[] for _ in prompts]
    for step in range(steps + 1):
        for s in range(len(prompts)):
            logits = ctx.get_logits_ith(s)
            assert (logits - alone[s][1][step]).abs().max().item() <= TOLERANCE
            generated[s].append(int(logits.argmax()))
        if step < steps:
            decode_ok(ctx, Batch(tokens=[g[-1] for g in generated], seq_ids=list(range(len(prompts))),
                                 logits=[True] * len(prompts)))
    for s, ids in enumerate(prompts):
        assert generated[s][:steps] == alone[s][0]
        with torch.no_grad():
            reference = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
        expected = reference[0, len(ids):].tolist()  # transformers stops after end-of-sequence
        assert generated[s][: len(expected)] == expected


def test_shared_prefix_through_seq_cp_equals_separate_prefills(smollm2):
    prefix = smollm2.tokenizer.encode("A long shared system prompt about geography and rivers.")
    suffixes = [smollm2.tokenizer.encode(" Question one:"), smollm2.tokenizer.encode(" Another question")]
    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence(prefix, seq_id=0))
    used_by_prefix = ctx.memory.n_used
    for s in (1, 2):
        ctx.memory.seq_cp(0, s, -1, -1)
    assert ctx.memory.n_used == used_by_prefix  # shared cells, not copies
    for s, suffix in zip((1, 2), suffixes):
        decode_ok(ctx, Batch.for_sequence(suffix, seq_id=s))
        shared = ctx.get_logits_ith(-1).clone()
        separate = new_context(smollm2)
        decode_ok(separate, Batch.for_sequence(prefix + suffix))
        assert (shared - separate.get_logits_ith(-1)).abs().max().item() <= TOLERANCE


def three_ubatch_batch(prompts) -> Batch:
    tokens = (prompts[0] * 8)[:40]
    return Batch(tokens=tokens, seq_ids=[1] * len(tokens))


def _decoded_after(ctx, prompts) -> torch.Tensor:
    decode_ok(ctx, Batch.for_sequence(prompts[2], seq_id=2))
    return ctx.get_logits_ith(-1).clone()


@pytest.mark.parametrize("failure", ["compute", "abort"])
def test_failure_in_micro_batch_two_of_three_rolls_everything_back(smollm2, prompts, monkeypatch, fail_forward_at,
                                                                   failure):
    clean = new_context(smollm2, n_ubatch=16)
    decode_ok(clean, Batch.for_sequence(prompts[1], seq_id=0))
    expected_state, expected_logits = memory_state(clean), _decoded_after(clean, prompts)

    ctx = new_context(smollm2, n_ubatch=16)
    decode_ok(ctx, Batch.for_sequence(prompts[1], seq_id=0))
    before, cells = memory_state(ctx), ctx.memory.cells
    if failure == "compute":
        fail_forward_at(smollm2.decoder, 2)
        expected_status = DecodeStatus.COMPUTE_FAILED
    else:
        calls = {"n": 0}
        ctx.abort_callback = lambda: calls.__setitem__("n", calls["n"] + 1) or calls["n"] == 2
        expected_status = DecodeStatus.ABORTED
    assert ctx.decode(three_ubatch_batch(prompts)) == expected_status
    assert "micro-batch 2 of 3" in ctx.last_error
    monkeypatch.undo()
    ctx.abort_callback = None
    assert memory_state(ctx) == before
    assert ctx.memory.cells is cells  # restored in place: the engine's prefix cache holds this object
    with pytest.raises(IndexError, match="did not succeed"):
        ctx.get_logits_ith(0)
    assert memory_state(ctx) == expected_state
    # Same cells, same shapes, same stored rows as the clean context: the same computation, bit for bit.
    assert torch.equal(_decoded_after(ctx, prompts), expected_logits)


@pytest.mark.parametrize("batch, message", [
    (Batch(tokens=[]), "empty"),
    (Batch(tokens=[1, 49152]), "49152"),
    (Batch(tokens=[1, 2], seq_ids=[0, 8]), "8"),
    (Batch(tokens=[1, 2], pos=[0, 2]), "consecutive|continue"),
    (Batch(tokens=[5] * 300), "n_batch is 256"),
])
def test_invalid_batches_are_refused_and_change_nothing(smollm2, batch, message):
    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence([1, 2, 3]))
    before = memory_state(ctx)
    assert ctx.decode(batch) == DecodeStatus.INVALID_BATCH
    assert ctx.last_error
    assert re.search(message, ctx.last_error), ctx.last_error
    assert memory_state(ctx) == before


def test_a_batch_that_does_not_fit_gets_no_slot_and_changes_nothing(smollm2, prompts):
    ctx = new_context(smollm2, n_ctx=32, n_batch=32, n_ubatch=8)
    decode_ok(ctx, Batch.for_sequence([1] * 20, seq_id=0))
    before = memory_state(ctx)
    assert ctx.decode(Batch.for_sequence([2] * 13, seq_id=1)) == DecodeStatus.NO_SLOT
    assert "13 cells" in ctx.last_error and "12 of 32" in ctx.last_error
    assert memory_state(ctx) == before
    decode_ok(ctx, Batch.for_sequence([2] * 12, seq_id=1))  # exactly what is free still fits


def test_one_sequence_past_n_ctx_gets_no_slot_before_any_row_is_written(smollm2):
    ctx = single_sequence_context(smollm2, 6)
    decode_ok(ctx, Batch.for_sequence([1, 2, 3, 4, 5]))
    before, stored = memory_state(ctx, [0]), (ctx.memory.store.k.data.clone(), ctx.memory.store.v.data.clone())
    assert ctx.decode(Batch.for_sequence([6, 7])) == DecodeStatus.NO_SLOT
    assert "2 cells" in ctx.last_error and "1 of 6" in ctx.last_error
    assert memory_state(ctx, [0]) == before
    assert torch.equal(ctx.memory.store.k.data, stored[0]) and torch.equal(ctx.memory.store.v.data, stored[1])
    decode_ok(ctx, Batch.for_sequence([6]))
    assert ctx.decode(Batch.for_sequence([7])) == DecodeStatus.NO_SLOT
    assert memory_state(ctx, [0]) == (6, [(0, 5)])


def test_rows_written_before_a_failure_stay_unseen_and_the_retry_equals_a_clean_run(smollm2, monkeypatch):
    prompt = [1, 504, 3458, 314]
    clean = single_sequence_context(smollm2, 32)
    decode_ok(clean, Batch.for_sequence(prompt))
    decode_ok(clean, Batch.for_sequence([42]))
    expected = clean.get_logits_ith(-1).clone()

    ctx = single_sequence_context(smollm2, 32)
    decode_ok(ctx, Batch.for_sequence(prompt))
    before, write = memory_state(ctx, [0]), ctx.memory.store.write
    middle = smollm2.config.n_layer // 2

    def write_then_fail(layer, rows, k, v):
        write(layer, rows, k, v)
        if layer == middle:
            raise RuntimeError(f"injected at layer {layer}")

    monkeypatch.setattr(ctx.memory.store, "write", write_then_fail)
    assert ctx.decode(Batch.for_sequence([42])) == DecodeStatus.COMPUTE_FAILED
    assert f"injected at layer {middle}" in ctx.last_error
    assert memory_state(ctx, [0]) == before
    monkeypatch.undo()
    # Layers 0..middle wrote the new row into a cell the rollback freed: unseen, then overwritten.
    decode_ok(ctx, Batch.for_sequence([42]))
    assert torch.equal(ctx.get_logits_ith(-1), expected)


def test_decode_uses_scattered_free_cells_and_compaction_changes_nothing(smollm2, prompts):
    ctx = new_context(smollm2)
    for s in range(3):
        decode_ok(ctx, Batch.for_sequence(prompts[s], seq_id=s))
    ctx.memory.seq_rm(1, -1, -1)  # leaves a hole in the middle
    decode_ok(ctx, Batch.for_sequence(prompts[3], seq_id=3))
    holes = ctx.memory.cells.used_max - ctx.memory.n_used
    decode_ok(ctx, Batch.for_sequence([42], seq_id=0))
    before = ctx.get_logits_ith(-1).clone()
    ctx.memory.seq_rm(0, ctx.memory.seq_pos_max(0), -1)
    state = memory_state(ctx)
    ctx.memory.compact()
    assert ctx.memory.cells.used_max == ctx.memory.n_used and holes >= 0
    assert memory_state(ctx) == state
    decode_ok(ctx, Batch.for_sequence([42], seq_id=0))
    assert (ctx.get_logits_ith(-1) - before).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("delta", [7, -3])
def test_shifted_sequence_equals_one_computed_at_the_shifted_positions(smollm2, delta):
    # Attention only sees relative positions, so moving a whole sequence by delta must give the logits
    # of the same tokens computed from position 3 + delta: the re-rotated K is all that differs.
    tokens = smollm2.tokenizer.encode("Alpha beta gamma delta epsilon zeta eta theta")
    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence(tokens, start_pos=3))
    ctx.memory.seq_add(0, -1, -1, delta)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (3 + delta, 3 + delta + len(tokens) - 1)
    decode_ok(ctx, Batch.for_sequence([42]))
    fresh = new_context(smollm2)
    decode_ok(fresh, Batch.for_sequence(tokens + [42], start_pos=3 + delta))
    assert (ctx.get_logits_ith(-1) - fresh.get_logits_ith(-1)).abs().max().item() <= TOLERANCE


def test_context_shift_keeps_n_keep_and_drops_the_oldest_half(smollm2):
    text = smollm2.tokenizer.encode("Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi")
    n_keep, n_discard = 2, (len(text) - 2) // 2
    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence(text))
    mem = ctx.memory
    mem.seq_rm(0, n_keep, n_keep + n_discard)
    mem.seq_add(0, n_keep + n_discard, -1, -n_discard)
    assert mem.n_used == len(text) - n_discard
    assert mem.cells.pos[mem.cells.seq_cells(0)].tolist() == list(range(len(text) - n_discard))
    decode_ok(ctx, Batch.for_sequence([42]))  # continues at the shifted end
    assert mem.seq_pos_max(0) == len(text) - n_discard


def test_seq_div_rotates_cached_keys_by_the_position_change(smollm2):
    from kvlm.core.rope import apply_rope

    tokens = smollm2.tokenizer.encode("one two three four five six")
    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence(tokens))
    cells = ctx.memory.cells.seq_cells(0)
    before = ctx.memory.store.k.data[:, cells].clone()
    old = ctx.memory.cells.pos[cells].copy()
    ctx.memory.seq_div(0, 2, -1, 2)
    new = ctx.memory.cells.pos[cells]
    assert new.tolist() == [0, 1] + [p // 2 for p in range(2, len(tokens))]
    ctx.memory.apply_shifts()
    cos, sin = smollm2.decoder.layer_ropes[0].shift_cos_sin(torch.from_numpy(new - old))
    for layer in (0, 17):
        expected = apply_rope(before[layer], cos, sin)
        assert torch.allclose(ctx.memory.store.k.data[layer, cells], expected, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8_0"])
def test_sequence_state_round_trip(smollm2, prompts, kv_dtype):
    ctx = new_context(smollm2, kv_dtype=kv_dtype)
    decode_ok(ctx, Batch.for_sequence(prompts[0], seq_id=0))
    blob = ctx.state_seq_save(0)
    decode_ok(ctx, Batch.for_sequence([42], seq_id=0))
    expected = ctx.get_logits_ith(-1).clone()
    other = new_context(smollm2, kv_dtype=kv_dtype)
    decode_ok(other, Batch.for_sequence(prompts[1], seq_id=0))
    other.state_seq_load(blob, 5)
    assert (other.memory.seq_pos_min(5), other.memory.seq_pos_max(5)) == (0, len(prompts[0]) - 1)
    assert other.state_seq_save(5) == blob  # the stored rows, bit for bit, in other cells
    decode_ok(other, Batch.for_sequence([42], seq_id=5))
    # Other cells and another sequence beside it: float32 noise at most, whatever the KV dtype, since
    # attention reads the same stored rows in the same (position) order.
    assert (other.get_logits_ith(-1) - expected).abs().max().item() <= TOLERANCE


def test_bad_states_are_refused_and_change_nothing(smollm2, prompts):
    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence(prompts[0], seq_id=0))
    blob = ctx.state_seq_save(0)
    target = new_context(smollm2)
    decode_ok(target, Batch.for_sequence(prompts[1], seq_id=1))
    before = memory_state(target)
    corrupt = bytearray(blob)
    corrupt[len(blob) // 2] ^= 0xFF
    cases = [(blob[: len(blob) // 3], "checksum|truncated"), (bytes(corrupt), "checksum"),
             (b"not a state at all", "magic")]
    for data, message in cases:
        with pytest.raises(CacheError, match=message):
            target.state_seq_load(data, 0)
    with pytest.raises(CacheError, match="kv_dtype"):
        target.state_seq_load(new_context(smollm2, kv_dtype="f16").state_seq_save(0), 0)
    with pytest.raises(CacheError, match="not empty"):
        target.state_seq_load(blob, 1)
    assert memory_state(target) == before


def test_state_from_another_model_is_refused(smollm2, prompts):
    import dataclasses

    from kvlm.memory.seq_state import decode_state, model_identity

    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence(prompts[0]))
    other_identity = model_identity(dataclasses.replace(smollm2.config, name="another model"))
    with pytest.raises(CacheError, match="model"):
        decode_state(ctx.state_seq_save(0), {"model": other_identity})


@pytest.mark.parametrize("kv_dtype, tolerance", [("f16", 0.05), ("bf16", 0.3), ("q8_0", 0.6)])
def test_smaller_kv_dtypes_stay_close_to_f32(smollm2, prompts, kv_dtype, tolerance):
    logits = {}
    for dtype in ("f32", kv_dtype):
        ctx = new_context(smollm2, kv_dtype=dtype)
        decode_ok(ctx, Batch.for_sequence(prompts[0]))
        decode_ok(ctx, Batch.for_sequence([42]))
        logits[dtype] = ctx.get_logits_ith(-1)
    assert (logits[kv_dtype] - logits["f32"]).abs().max().item() <= tolerance
    assert int(logits[kv_dtype].argmax()) == int(logits["f32"].argmax())


def test_context_creation_logs_the_kv_cache_like_llama_cpp(smollm2, caplog):
    with caplog.at_level("INFO", logger="kvlm"):
        ctx = new_context(smollm2, kv_dtype="f16")
    expected_mib = ctx.memory.kv_bytes / 2 / 2**20
    assert f"KV cache: 256 cells, 30 layers, K (f16): {expected_mib:.2f} MiB, V (f16): {expected_mib:.2f} MiB" \
        in caplog.text


def test_context_rejects_bad_sizes(smollm2):
    with pytest.raises(ValueError, match="n_ubatch \\(600\\) must not exceed n_batch \\(512\\)"):
        Context(smollm2, n_batch=512, n_ubatch=600)
    with pytest.raises(ValueError, match="n_ctx must be a positive integer, got 0"):
        Context(smollm2, n_ctx=0)
    with pytest.raises(ValueError, match="kv_dtype 'q2'"):
        Context(smollm2, kv_dtype="q2")
    ctx = new_context(smollm2)
    decode_ok(ctx, Batch.for_sequence([1, 2]))
    with pytest.raises(IndexError, match="index 1 is out of range: the last batch had 1 outputs"):
        ctx.get_logits_ith(1)


@pytest.mark.parametrize("error", [MemoryError("host"), torch.OutOfMemoryError("CUDA out of memory")])
def test_running_out_of_memory_mid_batch_is_alloc_failed_and_rolled_back(smollm2, monkeypatch, error):
    """The host's MemoryError and a GPU's torch.OutOfMemoryError alike: ALLOC_FAILED, the memory as before."""
    ctx = single_sequence_context(smollm2, 32)
    decode_ok(ctx, Batch.for_sequence([1, 2, 3]))
    before = memory_state(ctx, [0])

    def fail(*args):
        raise error

    monkeypatch.setattr(ctx.memory.store, "write", fail)
    assert ctx.decode(Batch.for_sequence([42])) == DecodeStatus.ALLOC_FAILED
    assert "out of memory in micro-batch 1 of 1" in ctx.last_error
    assert memory_state(ctx, [0]) == before
