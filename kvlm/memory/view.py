"""What one forward pass may do with the KV store: write its own rows, read the visible ones."""
from __future__ import annotations

import functools
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

    def layer_view(self, layer: int) -> tuple[KVView, int]:
        """The view layer `layer` attends through (this one), and its index in the store."""
        return self, layer

    @functools.cached_property
    def decode_cells(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of decode tokens, each reading its own rows (its own cell included): the cells each token
        reads, [n_tokens, L] padded, and how many of them, [n_tokens]. None for anything else (prompt chunks read
        shared rows through a mask). The same for every layer of the view, so found once."""
        n_tokens = len(self.rows)
        if self.groups is None:  # every token sees every visible row: decode tokens only if a few
            if self.mask is not None or n_tokens > MAX_SHARED_DECODE_TOKENS:
                return None
            return all_cells(self.n_visible).expand(n_tokens, -1), torch.full((n_tokens,), self.n_visible)
        if not all(g.lengths is not None or (len(g.tokens) == 1 and g.mask is None) for g in self.groups):
            return None
        if len(self.groups) == 1 and self.groups[0].lengths is not None and len(self.groups[0].tokens) == n_tokens:
            group = self.groups[0]
            if torch.equal(group.tokens, torch.arange(n_tokens)):
                return group.index, group.lengths
        longest = max(g.index.shape[-1] for g in self.groups)
        cells = torch.zeros(n_tokens, longest, dtype=torch.int64)
        lengths = torch.zeros(n_tokens, dtype=torch.int64)
        for group in self.groups:
            index = group.index if group.index.dim() == 2 else group.index[None]
            cells[group.tokens, :index.shape[1]] = index
            lengths[group.tokens] = group.lengths if group.lengths is not None else index.shape[1]
        return cells, lengths

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(layer, self.n_visible)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch_invariant: bool = False, native=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's K/V [n_tokens, n_kv, d] of `layer` (none for a layer reading another's: k, v None),
        then attend q over the visible rows (`native`: the native layer ops, for decode tokens; `sinks`: attention
        sinks' logits per head, or None)."""
        if k is not None:
            self.write(layer, k, v)
        return attend(q, layer, self, batch_invariant, native, sinks)


MAX_SHARED_DECODE_TOKENS = 4  # more tokens over the same rows (a prompt chunk) are faster in torch's fused kernel


@functools.cache
def _cell_numbers(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64)


def all_cells(n: int) -> torch.Tensor:
    """[1, n]: cells 0 .. n-1, a view of one cached range (grown in powers of two)."""
    return _cell_numbers(1 << max(n - 1, 0).bit_length())[:n][None]


@dataclass
class LayerViews:
    """A view per layer, for models whose layers see different memory (sliding-window and full attention, in one
    pool or in two; attention and recurrent layers): layer i goes through `by_layer[i] = (view, its index there)`."""

    by_layer: list[tuple[object, int]]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               batch_invariant: bool = False, native=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        view, local = self.by_layer[layer]
        return view.attend(local, q, k, v, batch_invariant, native, sinks)

    def recurrent(self, layer: int):
        """A recurrent layer's state for this micro-batch (see kvlm.memory.recurrent)."""
        view, local = self.by_layer[layer]
        return view.recurrent(local)

    def layer_view(self, layer: int) -> tuple[object, int]:
        """The view layer `layer` attends through, and its index in that view's store."""
        return self.by_layer[layer]
