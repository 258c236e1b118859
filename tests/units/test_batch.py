"""Decode batches: defaults filled in as llama.cpp does, every invalid batch refused with a named value, splits."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlm.core.batch import Batch, InvalidBatch, SanitizedBatch, sanitize
from kvlm.core.errors import KvlmError

VOCAB, N_SEQ, N_BATCH = 100, 4, 2048


def memory(ends: dict[int, int] | None = None):
    """seq_pos_max of a memory holding sequence s up to ends[s] (-1, empty, if absent); records the calls."""
    ends = ends or {}

    def seq_pos_max(s: int) -> int:
        seq_pos_max.calls.append(s)
        return ends.get(s, -1)

    seq_pos_max.calls = []
    return seq_pos_max


def run(batch: Batch, ends: dict[int, int] | None = None, **limits) -> SanitizedBatch:
    kwargs = dict(vocab_size=VOCAB, n_seq_max=N_SEQ, n_batch=N_BATCH) | limits
    return sanitize(batch, seq_pos_max=memory(ends), **kwargs)


def seqs_of(sb: SanitizedBatch) -> list[list[int]]:
    return [np.flatnonzero(row).tolist() for row in sb.seq_mask]


# --- defaults -------------------------------------------------------------------------------------------------------


def test_bare_tokens_go_to_sequence_0_continue_it_and_output_the_last():
    sb = run(Batch([5, 6, 7]), ends={0: 9})
    assert sb.tokens.dtype == np.int64 and sb.tokens.tolist() == [5, 6, 7]
    assert sb.pos.dtype == np.int64 and sb.pos.tolist() == [10, 11, 12]
    assert sb.seq_mask.dtype == bool and sb.seq_mask.shape == (3, N_SEQ)
    assert seqs_of(sb) == [[0], [0], [0]]
    assert sb.output.dtype == bool and sb.output.tolist() == [False, False, True]
    assert sb.n_outputs == 1
    assert sb.seq_ids_present().tolist() == [0]


def test_empty_sequence_starts_at_0():
    assert run(Batch([1, 2, 3, 4])).pos.tolist() == [0, 1, 2, 3]


def test_interleaved_sequences_each_continue_their_own_memory():
    seq_pos_max = memory({0: 4, 1: -1})
    sb = sanitize(Batch([1, 2, 3, 4], seq_ids=[0, 1, 0, 1]), vocab_size=VOCAB, n_seq_max=N_SEQ, n_batch=N_BATCH,
                  seq_pos_max=seq_pos_max)
    assert sb.pos.tolist() == [5, 0, 6, 1]
    assert seqs_of(sb) == [[0], [1], [0], [1]]
    assert sb.output.tolist() == [False, False, False, True]
    assert sb.seq_ids_present().tolist() == [0, 1]
    assert sorted(seq_pos_max.calls) == [0, 1]  # asked once per sequence in the batch, not for all n_seq_max


def test_shared_prompt_then_one_token_per_sequence():
    prompt = [10, 11, 12]
    batch = Batch(prompt + [20, 21, 22], seq_ids=[[0, 1, 2]] * 3 + [0, 1, 2], logits=[False] * 3 + [True] * 3)
    sb = run(batch)
    assert sb.pos.tolist() == [0, 1, 2, 3, 3, 3]
    assert seqs_of(sb) == [[0, 1, 2]] * 3 + [[0], [1], [2]]
    assert sb.n_outputs == 3
    assert sb.seq_ids_present().tolist() == [0, 1, 2]


def test_shared_token_takes_the_position_its_sequences_agree_on():
    sb = run(Batch([1, 2], seq_ids=[[2, 3], [3]]), ends={2: 6, 3: 6})
    assert sb.pos.tolist() == [7, 8]


def test_seq_ids_accept_tuples_and_numpy_values():
    sb = run(Batch(np.array([1, 2, 3]), seq_ids=[np.int32(1), (0, 2), np.array([3])], logits=[1, 0, 1]))
    assert seqs_of(sb) == [[1], [0, 2], [3]]
    assert sb.output.tolist() == [True, False, True]


def test_explicit_positions_and_logits_are_kept():
    sb = run(Batch([1, 2, 3], pos=[5, 6, 7], logits=[True, False, True]), ends={0: 4})
    assert sb.pos.tolist() == [5, 6, 7]
    assert sb.output.tolist() == [True, False, True]
    assert sb.n_outputs == 2


def test_explicit_positions_may_start_anywhere_in_an_empty_sequence():
    assert run(Batch([1, 2], pos=[40, 41], seq_ids=[1, 1])).pos.tolist() == [40, 41]


def test_for_sequence_with_and_without_start_pos():
    auto = Batch.for_sequence([1, 2, 3], seq_id=2)
    assert auto == Batch(tokens=[1, 2, 3], pos=None, seq_ids=[2, 2, 2], logits=None)
    assert run(auto, ends={2: 7}).pos.tolist() == [8, 9, 10]

    fixed = Batch.for_sequence((t for t in [1, 2]), start_pos=3)
    assert fixed.tokens == [1, 2] and fixed.pos == [3, 4] and fixed.seq_ids == [0, 0]
    sb = run(fixed, ends={0: 2})
    assert sb.pos.tolist() == [3, 4] and seqs_of(sb) == [[0], [0]] and sb.output.tolist() == [False, True]


def test_sanitized_batch_fields_cannot_be_reassigned():
    sb = run(Batch([1, 2]))
    with pytest.raises(AttributeError):
        sb.pos = np.zeros(2, dtype=np.int64)


# --- split ----------------------------------------------------------------------------------------------------------


def test_split_sizes_order_and_outputs():
    n = 1100
    logits = [i % 7 == 0 for i in range(n)]
    sb = run(Batch(list(np.arange(n) % VOCAB), seq_ids=[i % 2 for i in range(n)], logits=logits), n_batch=n)
    parts = sb.split(512)
    assert [len(p) for p in parts] == [512, 512, 76]
    assert np.concatenate([p.pos for p in parts]).tolist() == sb.pos.tolist()
    assert np.concatenate([p.tokens for p in parts]).tolist() == sb.tokens.tolist()
    assert np.concatenate([p.output for p in parts]).tolist() == logits
    assert sum(p.n_outputs for p in parts) == sb.n_outputs == sum(logits)
    assert np.array_equal(np.concatenate([p.seq_mask for p in parts]), sb.seq_mask)
    assert parts[1].pos[:2].tolist() == [256, 256]  # token 512 (seq 0) and 513 (seq 1), both at their 257th token


def test_split_edge_sizes():
    sb = run(Batch([1, 2, 3]))
    assert [len(p) for p in sb.split(3)] == [3]
    assert [len(p) for p in sb.split(1000)] == [3]
    assert [p.tokens.tolist() for p in sb.split(1)] == [[1], [2], [3]]
    assert sb.split(1)[-1].output.tolist() == [True]
    with pytest.raises(ValueError, match="n_ubatch must be at least 1, got 0"):
        sb.split(0)


# --- invalid batches ------------------------------------------------------------------------------------------------


def test_invalid_batch_is_a_value_error_and_a_kvlm_error():
    assert issubclass(InvalidBatch, ValueError) and issubclass(InvalidBatch, KvlmError)


@pytest.mark.parametrize("batch, ends, message", [
    (Batch([]), None, r"batch is empty"),
    (Batch([1] * 3000), None, r"batch has 3000 tokens, n_batch is 2048"),
    (Batch([1, 2], pos=[0]), None, r"pos has 1 entries but the batch has 2 tokens"),
    (Batch([1, 2], seq_ids=[0, 0, 0]), None, r"seq_ids has 3 entries but the batch has 2 tokens"),
    (Batch([1, 2], logits=[True]), None, r"logits has 1 entries but the batch has 2 tokens"),
    (Batch([1, -3]), None, r"tokens\[1\] = -3 is outside the vocabulary \[0, 100\)"),
    (Batch([1, 2, 100]), None, r"tokens\[2\] = 100 is outside the vocabulary \[0, 100\)"),
    (Batch([1, 2.5]), None, r"tokens\[1\] = 2.5 is not an integer"),
    (Batch([1, 2**70]), None, r"tokens\[1\] = 1180591620717411303424 does not fit in int64"),
    (Batch([1, 2], seq_ids=[0, 4]), None, r"seq_ids\[1\] = 4 is outside \[0, n_seq_max=4\)"),
    (Batch([1, 2], seq_ids=[-1, 0]), None, r"seq_ids\[0\] = -1 is outside \[0, n_seq_max=4\)"),
    (Batch([1, 2], seq_ids=[0, [1, 9]]), None, r"seq_ids\[1\]\[1\] = 9 is outside \[0, n_seq_max=4\)"),
    (Batch([1, 2], seq_ids=[0, []]), None, r"seq_ids\[1\] is empty: every token needs at least one sequence id"),
    (Batch([1, 2], seq_ids=[0, None]), None, r"seq_ids\[1\] = None is neither a sequence id nor a list"),
    (Batch([1, 2], seq_ids=[[0, 1], [2, 3, 2]]), None, r"seq_ids\[1\] = \[2, 3, 2\] repeats sequence id 2"),
    (Batch([1, 2], seq_ids=[0, [1, 0.5]]), None, r"seq_ids\[1\]\[1\] = 0.5 is not an integer"),
    (Batch([1, 2], logits=[True, "yes"]), None, r"logits\[1\] = 'yes' is not a boolean"),
    (Batch([1, 2], pos=[0, -1]), None, r"pos\[1\] = -1 is negative"),
    (Batch([1, 2], pos=[0, "1"]), None, r"pos\[1\] = '1' is not an integer"),
    (Batch([1, 2], pos=[7, 8]), {0: 4},
     r"sequence 0 starts at pos\[0\] = 7, but the memory holds it up to position 4: it must continue at 5"),
    (Batch([1, 2], pos=[3, 4]), {0: 4}, r"sequence 0 starts at pos\[0\] = 3, .* it must continue at 5"),
    (Batch([1, 2, 3], pos=[5, 6, 8]), {0: 4},
     r"sequence 0 is not consecutive: pos\[1\] = 6 is followed by pos\[2\] = 8, expected 7"),
    (Batch([1, 2, 3], pos=[2, 1, 3]), None,
     r"sequence 0 is not consecutive: pos\[0\] = 2 is followed by pos\[1\] = 1, expected 3"),
    (Batch([1, 2, 3], pos=[0, 0, 1]), None,
     r"sequence 0 is not consecutive: pos\[0\] = 0 is followed by pos\[1\] = 0, expected 1"),
    # interleaved sequences: the gap is between the tokens of sequence 1, named by their batch indices
    (Batch([1, 2, 3, 4], pos=[5, 0, 6, 2], seq_ids=[0, 1, 0, 1]), {0: 4},
     r"sequence 1 is not consecutive: pos\[1\] = 0 is followed by pos\[3\] = 2, expected 1"),
    # explicit positions of a shared token must fit each of its sequences
    (Batch([1, 2], pos=[5, 6], seq_ids=[[0, 1], 1]), {0: 4, 1: 8},
     r"sequence 1 starts at pos\[0\] = 5, but the memory holds it up to position 8: it must continue at 9"),
    (Batch([1, 2, 3], pos=[0, 1, 5], seq_ids=[[0, 2], 0, 2]), None,
     r"sequence 2 is not consecutive: pos\[0\] = 0 is followed by pos\[2\] = 5, expected 1"),
    # automatic positions: a shared token whose sequences end at different places
    (Batch([1, 2], seq_ids=[[0, 1], 1]), {0: 4},
     r"seq_ids\[0\] = \[0, 1\] shares token 0 between sequences that continue at different positions "
     r"\(sequence 0 at 5, sequence 1 at 0\)"),
])
def test_invalid_batches_are_named(batch, ends, message):
    with pytest.raises(InvalidBatch, match=message):
        run(batch, ends)


def test_shared_token_after_sequences_moved_in_step_is_valid():
    assert run(Batch([1, 2, 3], seq_ids=[0, 1, [0, 1]])).pos.tolist() == [0, 0, 1]


def test_auto_positions_report_the_first_disagreeing_token():
    # seq 0 continues at 5, seq 1 at 0; after tokens 0 and 1 they are at 6 and 1
    with pytest.raises(InvalidBatch, match=r"seq_ids\[2\] = \[0, 1\] .*\(sequence 0 at 6, sequence 1 at 1\)"):
        run(Batch([1, 2, 3], seq_ids=[0, 1, [0, 1]]), {0: 4})


def test_earliest_position_error_wins_across_sequences():
    # sequence 0 breaks at token 3, sequence 1 at token 2: token 2 is reported
    batch = Batch([1, 1, 1, 1], pos=[0, 0, 5, 9], seq_ids=[0, 1, 1, 0])
    with pytest.raises(InvalidBatch, match=r"sequence 1 is not consecutive: pos\[1\] = 0 .* pos\[2\] = 5"):
        run(batch)


def test_n_batch_is_a_limit_not_a_size():
    assert len(run(Batch([1] * 8), n_batch=8)) == 8
    with pytest.raises(InvalidBatch, match="batch has 9 tokens, n_batch is 8"):
        run(Batch([1] * 9), n_batch=8)


# --- property: sanitize, split, concatenate -------------------------------------------------------------------------


@st.composite
def valid_batches(draw):
    """A valid batch with explicit or automatic positions, single and shared tokens, and a memory to match."""
    n_seq_max = draw(st.integers(1, 6))
    ends = {s: draw(st.sampled_from([-1, -1, 0, 7, 40])) for s in range(n_seq_max)}  # few values: some share
    n = draw(st.integers(1, 300))
    # A shared prompt (llama.cpp's usual shape): the first k tokens go to one group of sequences that end at the
    # same place, so they stay in step; then every token goes to one sequence.
    in_step = [s for s in range(n_seq_max) if ends[s] == ends[0]]
    group = [0, *draw(st.lists(st.sampled_from(in_step), unique=True))] if len(in_step) > 1 else [0]
    group = list(dict.fromkeys(group))
    k = draw(st.integers(0, n)) if len(group) > 1 else 0
    seq_ids: list[int | list[int]] = [group] * k + draw(
        st.lists(st.integers(0, n_seq_max - 1), min_size=n - k, max_size=n - k)
    )
    explicit = draw(st.booleans())
    pos = None
    if explicit:
        nxt = {s: e + 1 for s, e in ends.items()}
        pos = []
        for s in seq_ids:
            group = s if isinstance(s, list) else [s]
            pos.append(nxt[group[0]])
            for t in group:
                nxt[t] = pos[-1] + 1
    logits = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return Batch(tokens, pos=pos, seq_ids=seq_ids, logits=logits), ends, n_seq_max


@settings(max_examples=150, deadline=None)
@given(case=valid_batches(), n_ubatch=st.integers(1, 400))
def test_split_then_concatenate_is_the_sanitized_batch(case, n_ubatch):
    batch, ends, n_seq_max = case
    sb = sanitize(batch, vocab_size=VOCAB, n_seq_max=n_seq_max, n_batch=N_BATCH, seq_pos_max=ends.__getitem__)
    n = len(batch.tokens)
    assert sb.tokens.shape == sb.pos.shape == sb.output.shape == (n,) and sb.seq_mask.shape == (n, n_seq_max)
    assert sb.n_outputs == (1 if batch.logits is None else sum(batch.logits))
    parts = sb.split(n_ubatch)
    assert all(1 <= len(p) <= n_ubatch for p in parts)
    assert len(parts) == -(-n // n_ubatch)
    assert all(len(p) == n_ubatch for p in parts[:-1])
    for name in ("tokens", "pos", "seq_mask", "output"):
        assert np.array_equal(np.concatenate([getattr(p, name) for p in parts]), getattr(sb, name)), name
    if batch.pos is not None:  # the strategy's positions are llama.cpp's automatic ones: sanitize agrees
        auto = Batch(batch.tokens, seq_ids=batch.seq_ids, logits=batch.logits)
        limits = dict(vocab_size=VOCAB, n_seq_max=n_seq_max, n_batch=N_BATCH, seq_pos_max=ends.__getitem__)
        assert np.array_equal(sanitize(auto, **limits).pos, sb.pos)
    # positions advance by one per token within every sequence, starting where the memory ends
    for s in sb.seq_ids_present():
        p = sb.pos[sb.seq_mask[:, s]]
        assert np.all(np.diff(p) == 1)
        if ends[s] >= 0:
            assert p[0] == ends[s] + 1
