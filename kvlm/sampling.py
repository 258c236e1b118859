"""Choosing the next token from logits."""
from __future__ import annotations

import torch


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, otherwise a draw from softmax(logits / temperature)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
