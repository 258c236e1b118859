"""What one forward pass may do with the KV store: write its own rows, read the visible ones."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.memory.kv_store import KVStore
from kvlm.model.attention import attend


@dataclass
class AttentionGroup:
    """Tokens that attend over only their own rows of the store, in position order.

    `index` is [L] when the tokens share their rows (the tokens of one sequence: its cells, gathered
    once) or [n, L] when each token has its own (one decode token per sequence). `mask` is additive,
    [n, L], hiding future positions and padding; None when every token sees every row.
    """

    tokens: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor | None
    lengths: torch.Tensor | None = None  # with a [n, L] index: how many of each token's rows are real (the rest pad)


@dataclass
class KVView:
    store: KVStore
    rows: torch.Tensor          # the cells this step's tokens are written to, one per token
    n_visible: int              # cells 0 .. n_visible-1 are read by attention
    mask: torch.Tensor | None   # additive [n_tokens, n_visible]; None when every token sees every row
    groups: list[AttentionGroup] | None = None  # instead of `mask`: which tokens read which rows

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store.write(layer, self.rows, k, v)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(layer, self.n_visible)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch_invariant: bool = False, native=None) -> torch.Tensor:
        """Write the step's K/V [n_tokens, n_kv, d] of `layer`, then attend q over the visible rows (`native`: the
        native layer ops, for decode tokens)."""
        self.write(layer, k, v)
        return attend(q, layer, self, batch_invariant, native)


@dataclass
class LayerViews:
    """A view per layer, for models whose layers see different memory (sliding-window and full attention, in one
    pool or in two; attention and recurrent layers): layer i goes through `by_layer[i] = (view, its index there)`."""

    by_layer: list[tuple[object, int]]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch_invariant: bool = False, native=None) -> torch.Tensor:
        view, local = self.by_layer[layer]
        return view.attend(local, q, k, v, batch_invariant, native)

    def recurrent(self, layer: int):
        """A recurrent layer's state for this micro-batch (see kvlm.memory.recurrent)."""
        view, local = self.by_layer[layer]
        return view.recurrent(local)
