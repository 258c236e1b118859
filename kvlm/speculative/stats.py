"""Counts of speculative decoding, as vLLM's spec_decode metrics count them (an engine's, and one request's)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def n_matching(guesses: Sequence[int], emitted: Sequence[int]) -> int:
    """How many guesses, from the first, equal the tokens emitted in their places."""
    n = 0
    for guess, token in zip(guesses, emitted):
        if guess != token:
            break
        n += 1
    return n


@dataclass
class SpecStats:
    """Counts since the engine started, as vLLM's spec_decode metrics count them."""

    num_drafts: int = 0            # verification rounds (a request with at least one guess in a step)
    num_draft_tokens: int = 0      # guesses verified
    num_accepted_tokens: int = 0   # guesses accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at guess position 0, 1, ...

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification round: 1 + accepted / rounds (vLLM's; the target's own token included)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_json(self) -> dict:
        rounds = max(self.num_drafts, 1)
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_per_position": [n / rounds for n in self.accepted_per_pos]}

    def count(self, n_guesses: int, n_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += n_guesses
        self.num_accepted_tokens += n_accepted
        while len(self.accepted_per_pos) < n_guesses:
            self.accepted_per_pos.append(0)
        for position in range(n_accepted):
            self.accepted_per_pos[position] += 1
