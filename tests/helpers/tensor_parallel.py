"""What the tensor-parallel modules share: their models' vocabulary size, and outputs on two ranks against one's."""
from __future__ import annotations

TOLERANCE = 1e-4
VOCAB = 1000


def assert_same_outputs(ours, expected) -> None:
    for a, b in zip(ours, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= TOLERANCE
