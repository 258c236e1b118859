"""Prompt lookup against vLLM's own example and against a brute-force reading of its rule."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlm.speculative.ngram import propose_ngram


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out: longest n first; for it, the earliest earlier occurrence; what follows it."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # the occurrence must end before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_vllm_docstring_example():
    # vLLM's NgramProposer.propose: [1,2,3,4,2,3], min_n=2, max_n=3, k=4 -> [4,2,3]
    assert propose_ngram([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_longest_match_wins_over_a_later_shorter_one():
    tokens = [7, 8, 9, 1, 5, 9, 1, 6, 7, 8, 9, 1]
    assert propose_ngram(tokens, 1, 4, 2) == [5, 9]  # [7,8,9,1] at 0 beats [9,1] at 5
    assert propose_ngram(tokens, 1, 2, 2) == [5, 9]  # of the [9,1]s, the earliest


def test_no_guess_without_a_match_or_room():
    assert propose_ngram([1, 2, 3], 1, 3, 4) == []
    assert propose_ngram([5], 1, 1, 4) == []
    assert propose_ngram([1, 2, 1, 2], 1, 2, 4, max_len=4) == []  # the context is full
    assert propose_ngram([1, 2, 1, 2], 1, 2, 4, max_len=5) == [1]
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        propose_ngram([1, 2], 3, 2, 4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=40), st.integers(1, 4), st.integers(0, 3),
       st.integers(1, 6))
def test_equals_the_rule_spelled_out(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert propose_ngram(tokens, min_n, max_n, k) == brute_force(tokens, min_n, max_n, k)
