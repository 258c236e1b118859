"""Rotary position embeddings: the frequencies a model's config asks for, and the rotations they give."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """How a model's RoPE frequencies are made; `kind` names transformers' rope_type."""

    theta: float = 10000.0
    kind: str = "default"


class Rope:
    """cos/sin for positions read at run time; `shift_cos_sin` rotates cached K by a position change."""

    def __init__(self, scaling: RopeScaling, head_dim: int) -> None:
        self.scaling = scaling
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (scaling.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.attention_factor = 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n_tokens, 1, head_dim] of the rotation at `positions`, attention factor included."""
        cos, sin = _cos_sin(positions, self.inv_freq)
        return (cos * self.attention_factor).to(dtype), (sin * self.attention_factor).to(dtype)

    def shift_cos_sin(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pure rotation by `deltas` (no attention factor: cached K already carries it once)."""
        return _cos_sin(deltas, self.inv_freq)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos(), angles.sin()
