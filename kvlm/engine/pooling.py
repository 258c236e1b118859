"""Embeddings: a request's prompt pooled into one vector from the final norm's output (llama.cpp's pooling types).

- "last": the last token's state (decoder embedding models, such as Qwen3-Embedding, which read the whole text
  through causal attention there);
- "mean": the mean over every token of the prompt;
- "cls": the first token's.

The vector is L2-normalized, as OpenAI's embeddings and vLLM's defaults are. "last" may reuse a cached prefix (the
last token is always computed); "mean" and "cls" need states of tokens a cached prefix would skip, so they
compute the whole prompt.
"""
from __future__ import annotations

import torch

from kvlm.core.config import POOLINGS


def checked_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


class Pooler:
    """One request's pooling, fed the states of its prompt's chunks as the engine computes them."""

    def __init__(self, kind: str) -> None:
        self.kind = checked_pooling(kind)
        self._sum: torch.Tensor | None = None
        self._n = 0

    @property
    def reuses_prefix(self) -> bool:
        return self.kind == "last"

    def output_rows(self, start: int, n_tokens: int, ends_prompt: bool) -> list[bool]:
        """Which tokens of a chunk (positions start .. start + n_tokens - 1) give the states pooled."""
        if self.kind == "mean":
            return [True] * n_tokens
        if self.kind == "cls":
            return [start == 0] + [False] * (n_tokens - 1)
        return [False] * (n_tokens - 1) + [ends_prompt]

    def reset(self) -> None:
        """Forget what was added: the request's prompt is computed again (it was preempted)."""
        self._sum, self._n = None, 0

    def add(self, states: torch.Tensor) -> None:
        """The chunk's states at its output rows [n, n_embd]."""
        if len(states):
            total = states.double().sum(dim=0)
            self._sum = total if self._sum is None else self._sum + total
            self._n += len(states)

    def result(self) -> list[float]:
        return normalized(self._sum / self._n)


def normalized(vector: torch.Tensor) -> list[float]:
    return (vector / vector.norm().clamp_min(1e-12)).float().tolist()


def checked_dimensions(dimensions: int | None, n_embd: int) -> int | None:
    if dimensions is not None and not 1 <= dimensions <= n_embd:
        raise ValueError(f"dimensions must be between 1 and {n_embd} (the model's embedding size), got {dimensions}")
    return dimensions


def truncated(embedding: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, normalized again (Matryoshka embeddings, OpenAI's `dimensions`)."""
    if checked_dimensions(dimensions, len(embedding)) is None or dimensions == len(embedding):
        return embedding
    return normalized(torch.tensor(embedding[:dimensions], dtype=torch.float64))
