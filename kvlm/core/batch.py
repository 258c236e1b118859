"""Input batches for one decode call, sanitised and validated the way llama.cpp's batch allocator does it.

A :class:`Batch` is what a caller hands to decode: tokens, and optionally per-token positions, sequence ids and
output flags (llama.cpp's ``llama_batch``). :func:`sanitize` fills in what is missing (``llama_batch_allocr::init``:
sequence 0, the last token as the only output, positions continuing each sequence's memory) and checks every field,
turning a bad batch into an :class:`InvalidBatch` whose message names the value, its index and the limit, never an
assert. :meth:`SanitizedBatch.split` cuts the result into micro-batches in batch order (llama.cpp's
``split_simple``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvlm.core.errors import KvlmError

_INT64_MIN, _INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max


class InvalidBatch(KvlmError, ValueError):
    """A batch handed to decode breaks a rule; the message names the bad value, its index and the limit."""


@dataclass
class Batch:
    """One decode call's input; ``None`` fields are filled in by :func:`sanitize`."""

    tokens: list[int]
    pos: list[int] | None = None
    seq_ids: list[int | list[int]] | None = None  # per token: one sequence id, or several for a shared token
    logits: list[bool] | None = None  # per token: output its logits?

    @classmethod
    def for_sequence(cls, tokens: Sequence[int], seq_id: int = 0, start_pos: int | None = None) -> Batch:
        """All ``tokens`` to sequence ``seq_id``; positions ``start_pos, start_pos + 1, ...`` or automatic if None."""
        tokens = list(tokens)
        pos = None if start_pos is None else list(range(start_pos, start_pos + len(tokens)))
        return cls(tokens=tokens, pos=pos, seq_ids=[seq_id] * len(tokens))


@dataclass(frozen=True, eq=False)
class SanitizedBatch:
    """A validated batch as NumPy arrays, ready for the memory and the model.

    The fields cannot be reassigned; the arrays stay writable because ``torch.from_numpy`` warns on read-only ones.
    """

    tokens: np.ndarray  # int64 [n]
    pos: np.ndarray  # int64 [n]
    seq_mask: np.ndarray  # bool [n, n_seq_max]: seq_mask[i, s] is True if token i belongs to sequence s
    output: np.ndarray  # bool [n]: return the logits of token i?
    rows: np.ndarray | None = None  # a micro-batch in another order: the batch's index of each of its tokens

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_outputs(self) -> int:
        return int(np.count_nonzero(self.output))

    def seq_ids_present(self) -> np.ndarray:
        """The sequence ids used by at least one token of the batch, ascending."""
        return np.flatnonzero(self.seq_mask.any(axis=0))

    def split(self, n_ubatch: int) -> list[SanitizedBatch]:
        """Consecutive micro-batches of at most ``n_ubatch`` tokens, in batch order (llama.cpp's split_simple)."""
        if n_ubatch < 1:
            raise ValueError(f"n_ubatch must be at least 1, got {n_ubatch}")
        return [self[i : i + n_ubatch] for i in range(0, len(self), n_ubatch)]

    def split_equal(self, n_ubatch: int) -> list[SanitizedBatch]:
        """Micro-batches in which every sequence present has the same number of tokens, laid out sequence after
        sequence, each sequence's tokens in batch order (llama.cpp's split_equal): a recurrent layer then sees
        them as [n_seqs, n_tokens]. Every token must belong to one sequence."""
        if n_ubatch < 1:
            raise ValueError(f"n_ubatch must be at least 1, got {n_ubatch}")
        owner = self.seq_mask.argmax(axis=1)
        _, first_rows = np.unique(owner, return_index=True)
        queues = [np.flatnonzero(owner == owner[row]) for row in sorted(first_rows)]
        ubatches = []
        while queues:
            taken = queues[:n_ubatch]
            n_each = min(min(len(q) for q in taken), n_ubatch // len(taken))
            rows = np.concatenate([q[:n_each] for q in taken])
            ubatches.append(SanitizedBatch(self.tokens[rows], self.pos[rows], self.seq_mask[rows], self.output[rows],
                                           rows))
            queues = [q[n_each:] for q in taken if len(q) > n_each] + queues[n_ubatch:]
        return ubatches

    def __getitem__(self, rows: slice) -> SanitizedBatch:
        """The tokens ``rows`` (a slice) as a batch of their own; the arrays are views."""
        if not isinstance(rows, slice):
            raise TypeError(f"SanitizedBatch can only be sliced, got {type(rows).__name__}")
        return SanitizedBatch(self.tokens[rows], self.pos[rows], self.seq_mask[rows], self.output[rows])

    def __repr__(self) -> str:
        return (
            f"SanitizedBatch(n_tokens={len(self)}, n_outputs={self.n_outputs}, "
            f"seqs={self.seq_ids_present().tolist()})"
        )


def sanitize(
    batch: Batch, *, vocab_size: int, n_seq_max: int, n_batch: int, seq_pos_max: Callable[[int], int]
) -> SanitizedBatch:
    """Fill in a batch's missing fields and validate it; raise :class:`InvalidBatch` on the first broken rule.

    ``seq_pos_max(s)`` is the last position the memory holds for sequence ``s`` (-1 if it holds none); it is
    called once for each sequence the batch uses.
    """
    n = len(batch.tokens)
    if n == 0:
        raise InvalidBatch("batch is empty: it must have at least one token")
    if n > n_batch:
        raise InvalidBatch(f"batch has {n} tokens, n_batch is {n_batch}")
    for name in ("pos", "seq_ids", "logits"):
        values = getattr(batch, name)
        if values is not None and len(values) != n:
            raise InvalidBatch(f"{name} has {len(values)} entries but the batch has {n} tokens")

    tokens = _int64_array("tokens", batch.tokens)
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidBatch(f"tokens[{i}] = {tokens[i]} is outside the vocabulary [0, {vocab_size})")

    seq_mask, first_seq = _seq_mask(batch.seq_ids, n, n_seq_max)
    present = np.flatnonzero(seq_mask.any(axis=0))
    next_pos = np.zeros(n_seq_max, dtype=np.int64)  # where each sequence continues: its memory's last position + 1
    next_pos[present] = [int(seq_pos_max(int(s))) + 1 for s in present]
    # Token i is the k-th token of sequence s in the batch: it continues s at next_pos[s] + k.
    continues_at = next_pos + np.cumsum(seq_mask, axis=0, dtype=np.int64) - seq_mask

    if batch.pos is None:
        pos = continues_at[np.arange(n), first_seq]
        disagree = np.flatnonzero((seq_mask & (continues_at != pos[:, None])).any(axis=1))
        if disagree.size:
            i = int(disagree[0])
            seqs = np.flatnonzero(seq_mask[i])
            at = ", ".join(f"sequence {s} at {continues_at[i, s]}" for s in seqs)
            raise InvalidBatch(
                f"seq_ids[{i}] = {seqs.tolist()} shares token {i} between sequences that continue at different "
                f"positions ({at}); a shared token must extend sequences that end at the same position"
            )
    else:
        pos = _int64_array("pos", batch.pos)
        negative = np.flatnonzero(pos < 0)
        if negative.size:
            i = int(negative[0])
            raise InvalidBatch(f"pos[{i}] = {pos[i]} is negative")
        _check_positions(pos, seq_mask, present, next_pos)

    if batch.logits is None:
        output = np.zeros(n, dtype=bool)
        output[-1] = True
    else:
        output = _bool_array("logits", batch.logits)

    return SanitizedBatch(tokens=tokens, pos=pos, seq_mask=seq_mask, output=output)


def _check_positions(pos: np.ndarray, seq_mask: np.ndarray, present: np.ndarray, next_pos: np.ndarray) -> None:
    """Each sequence must continue its memory (if it has any) and advance by exactly 1 per token, in batch order.

    Of all violations, the one at the earliest token is reported.
    """
    # Token i, the k-th of sequence s here, must be at start[s] + k: where the memory ends, else where s's first
    # token is. One pass over the [n, n_seq_max] mask; the loop below only names what is wrong.
    first = seq_mask.argmax(axis=0)
    start = np.where(next_pos > 0, next_pos, pos[first])
    expected = start + np.cumsum(seq_mask, axis=0, dtype=np.int64) - seq_mask
    if np.all(~seq_mask | (expected == pos[:, None])):
        return
    problems: list[tuple[int, str]] = []
    for s in present:
        rows = np.flatnonzero(seq_mask[:, s])
        first = int(rows[0])
        if next_pos[s] > 0 and pos[first] != next_pos[s]:
            problems.append((first, (
                f"sequence {s} starts at pos[{first}] = {pos[first]}, but the memory holds it up to position "
                f"{next_pos[s] - 1}: it must continue at {next_pos[s]}"
            )))
        jumps = np.flatnonzero(np.diff(pos[rows]) != 1)
        if jumps.size:
            prev, cur = int(rows[jumps[0]]), int(rows[jumps[0] + 1])
            problems.append((cur, (
                f"sequence {s} is not consecutive: pos[{prev}] = {pos[prev]} is followed by pos[{cur}] = {pos[cur]}, "
                f"expected {pos[prev] + 1}"
            )))
    if problems:
        raise InvalidBatch(min(problems)[1])


def _seq_mask(seq_ids: Sequence[int | Sequence[int]] | None, n: int, n_seq_max: int) -> tuple[np.ndarray, np.ndarray]:
    """The [n, n_seq_max] membership mask and each token's first sequence id (which gives its automatic position)."""
    mask = np.zeros((n, n_seq_max), dtype=bool)
    if seq_ids is None:
        if n_seq_max < 1:
            raise InvalidBatch(f"seq_ids is missing, so every token goes to sequence 0, but n_seq_max is {n_seq_max}")
        mask[:, 0] = True
        return mask, np.zeros(n, dtype=np.int64)

    groups = [[s] if _is_int(s) else s for s in seq_ids]
    for i, group in enumerate(groups):
        if isinstance(group, (str, bytes)) or not isinstance(group, (Sequence, np.ndarray)):
            raise InvalidBatch(f"seq_ids[{i}] = {group!r} is neither a sequence id nor a list of sequence ids")
        if len(group) == 0:
            raise InvalidBatch(f"seq_ids[{i}] is empty: every token needs at least one sequence id")
    counts = np.fromiter((len(g) for g in groups), dtype=np.int64, count=n)
    flat_values = [s for g in groups for s in g]
    flat = _int64_array("seq_ids", flat_values, index=_nested_index(counts))
    token = np.repeat(np.arange(n), counts)

    bad = np.flatnonzero((flat < 0) | (flat >= n_seq_max))
    if bad.size:
        k = int(bad[0])
        raise InvalidBatch(f"{_nested_index(counts)(k)} = {flat[k]} is outside [0, n_seq_max={n_seq_max})")
    mask[token, flat] = True
    repeated = np.flatnonzero(mask.sum(axis=1) != counts)
    if repeated.size:
        i = int(repeated[0])
        ids = flat[token == i]
        dup = next(int(s) for j, s in enumerate(ids) if s in ids[:j])
        raise InvalidBatch(f"seq_ids[{i}] = {ids.tolist()} repeats sequence id {dup}")
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return mask, flat[starts]


def _nested_index(counts: np.ndarray) -> Callable[[int], str]:
    """Name the k-th flattened sequence id as ``seq_ids[i]`` or ``seq_ids[i][j]``."""
    starts = np.concatenate(([0], np.cumsum(counts)))

    def name(k: int) -> str:
        i = int(np.searchsorted(starts, k, side="right")) - 1
        return f"seq_ids[{i}]" if counts[i] == 1 else f"seq_ids[{i}][{k - starts[i]}]"

    return name


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _int64_array(name: str, values: Sequence[int], index: Callable[[int], str] | None = None) -> np.ndarray:
    """``values`` as an int64 array; a non-integer or out-of-int64 entry is named with its index."""
    index = index or (lambda k: f"{name}[{k}]")
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):
        array = np.asarray(values, dtype=object)
    if array.ndim == 1 and (array.size == 0 or array.dtype.kind in "iu"):
        if array.dtype.kind == "u" and array.size and array.max() > _INT64_MAX:
            k = int(np.argmax(array > _INT64_MAX))
            raise InvalidBatch(f"{index(k)} = {array[k]} does not fit in int64")
        return array.astype(np.int64)
    for k, value in enumerate(values):
        if not _is_int(value):
            raise InvalidBatch(f"{index(k)} = {value!r} is not an integer")
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise InvalidBatch(f"{index(k)} = {value} does not fit in int64")
    return np.asarray([int(v) for v in values], dtype=np.int64)  # not reached for well-formed input


def _bool_array(name: str, values: Sequence[bool]) -> np.ndarray:
    """Output flags: booleans, or integers read as llama.cpp's int8 flags (non-zero is True)."""
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):
        array = np.asarray(values, dtype=object)
    if array.ndim == 1 and array.dtype.kind in "biu":
        return array != 0
    for k, value in enumerate(values):
        if not isinstance(value, (bool, np.bool_, int, np.integer)):
            raise InvalidBatch(f"{name}[{k}] = {value!r} is not a boolean")
    return np.asarray([bool(v) for v in values], dtype=bool)
