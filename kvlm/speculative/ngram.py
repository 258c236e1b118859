"""Prompt lookup (vLLM's `ngram` method): guess the next tokens by finding the sequence's own last n tokens
earlier in it (prompt and output so far) and copying what followed.

vLLM's rule, kept exactly: the longest n-gram in [min_n, max_n] that ends the sequence and also occurs earlier;
of several occurrences of that n-gram, the earliest; then up to k of the tokens after it (fewer when the sequence
ends sooner, none past `max_len` tokens in all). No occurrence: no guess, the request decodes normally.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int, k: int,
                  max_len: int | None = None) -> list[int]:
    """Up to k guessed tokens after `tokens`, or [] when no n-gram of the end occurs earlier."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
    ids = np.asarray(tokens, dtype=np.int64)
    total = ids.shape[0]
    if max_len is not None:
        k = min(k, max_len - total)
    if k <= 0 or total < min_n + 1:
        return []
    # Every earlier place the last token occurs (something follows it), then how far back each match reaches:
    # one pass per length over a few candidates, instead of comparing every window of every length.
    ends = np.flatnonzero(ids[: total - 1] == ids[-1])
    lengths = np.ones(ends.shape[0], dtype=np.int64)
    matching = np.ones(ends.shape[0], dtype=bool)
    for back in range(1, min(max_n, total - 1)):
        matching &= ends >= back
        matching[matching] = ids[ends[matching] - back] == ids[total - 1 - back]
        if not matching.any():
            break
        lengths += matching
    if not ends.size or lengths.max() < min_n:
        return []
    longest = int(lengths.max())
    start = int(ends[np.argmax(lengths >= longest)]) + 1  # the earliest occurrence of the longest n-gram
    return ids[start : start + k].tolist()
