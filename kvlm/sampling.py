"""Choosing the next token from logits: the single-sequence loop's entry to kvlm.engine.sampler."""
from __future__ import annotations

import torch

from kvlm.engine.sampler import draw
from kvlm.engine.sampling_params import SamplingParams


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, otherwise a draw from softmax(logits / temperature) with `generator`.

    Requests that need top-k/top-p/min-p, penalties or logprobs use kvlm.engine.sampler.RequestSampler.
    """
    params = SamplingParams(temperature=temperature)  # ValueError for a negative temperature
    if params.greedy:
        return int(torch.argmax(logits))
    return draw(logits, params, generator)
