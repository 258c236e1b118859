"""What one forward pass may do with the KV store: write its own rows, read the visible ones."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.memory.kv_store import KVStore


@dataclass
class KVView:
    store: KVStore
    rows: torch.Tensor          # the cells this step's tokens are written to, one per token
    n_visible: int              # cells 0 .. n_visible-1 are read by attention
    mask: torch.Tensor | None   # additive [n_tokens, n_visible], or [n_tokens, L] with gather_index; None: all visible
    gather_index: torch.Tensor | None = None  # [n_tokens, L]: each token reads only these rows

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store.write(layer, self.rows, k, v)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(layer, self.n_visible)
