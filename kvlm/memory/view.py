"""What one forward pass may do with the KV store: write its own rows, read the visible ones. The memory hands out
rows and which tokens read them; the layers attend (kvlm.model.attention)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvlm.core.staging import staged_together
from kvlm.memory.kv_store import KVStore

if TYPE_CHECKING:
    from kvlm.memory.recurrent import LayerState


class MemoryView(Protocol):
    """What a decoder's layers receive from the memory for one micro-batch, whatever its kind (every memory's
    `view` returns one): an attention layer asks `layer_view` for where to write this step's K/V (`KVView.rows`) and
    which cells each token reads (`KVView.groups`, `KVView.token_cells`, with the masks); a recurrent layer asks
    `recurrent` for its state slots, to read and to replace. Nothing written through a view is visible to another
    call before the memory commits the batch."""

    def layer_view(self, layer: int) -> tuple[KVView, int]:
        """The view layer `layer` attends through, and the layer's index in that view's store."""

    def recurrent(self, layer: int) -> LayerState:
        """The state of recurrent layer `layer` for this micro-batch's sequences."""


@dataclass
class AttentionGroup:
    """Tokens that attend over only their own rows of the store, in position order.

    `index` is [L] when the tokens share their rows (the tokens of one sequence: its cells, gathered
    once) or [n, L] when each token has its own (one decode token per sequence). `mask` is additive,
    [n, L], hiding future positions and padding; None when every token sees every row. Each token's rows are
    one run of its index: from `starts` (shared rows; None: from the first) and `lengths` long (None: all of them).
    """

    tokens: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor | None
    lengths: torch.Tensor | None = None
    starts: torch.Tensor | None = None

    def to(self, device: torch.device) -> AttentionGroup:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return AttentionGroup(move(self.tokens), move(self.index), move(self.mask), move(self.lengths),
                              move(self.starts))


@dataclass(frozen=True)
class TokenCells:
    """The cells each token of a forward pass reads, in position order, as the native attention takes them: token t
    reads cells[offsets[t]] .. cells[offsets[t] + lengths[t] - 1] (all int64, contiguous). The tokens of one
    sequence's prompt point into one shared run of cells; a decode token into its own."""

    cells: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    # offsets and lengths on the host, where the tensors are on a GPU: what a kernel's launch is planned from without
    # waiting for the device (kvlm.kernels.gpu.attention)
    host: tuple[np.ndarray, np.ndarray] | None = None
    plans: dict = field(default_factory=dict, compare=False)  # a kernel's launch plans for these cells, by its key
    # a CUDA graph's step (kvlm.model.cuda_graphs): every token reads a run of its own, and a kernel splits each run
    # this many ways whatever its length (the launch was captured once; the lengths change at every replay)
    fixed_splits: int = 0

    def to(self, device: torch.device, rows: torch.Tensor) -> tuple[torch.Tensor, TokenCells]:
        """`rows` (the cells the step writes) and these cells on `device`, in one copy; their offsets and lengths
        kept on the host too."""
        host = self.host or (self.offsets.numpy(), self.lengths.numpy())
        rows, cells, offsets, lengths = staged_together(device, rows, self.cells, self.offsets, self.lengths)
        return rows, TokenCells(cells, offsets, lengths, host)

    def on_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, lengths) as NumPy arrays, read back from the device only where no host copy was kept."""
        return self.host or (self.offsets.cpu().numpy(), self.lengths.cpu().numpy())

    @classmethod
    def of(cls, groups: list[AttentionGroup], n_tokens: int) -> TokenCells:
        """From a view's groups, on the host."""
        runs, offsets = [], torch.zeros(n_tokens, dtype=torch.int64)
        lengths = torch.zeros(n_tokens, dtype=torch.int64)
        first = 0
        for group in groups:
            if group.index.dim() == 2:  # a row of cells per token
                offsets[group.tokens] = first + torch.arange(len(group.tokens)) * group.index.shape[1]
            else:
                offsets[group.tokens] = first + (0 if group.starts is None else group.starts)
            lengths[group.tokens] = group.index.shape[-1] if group.lengths is None else group.lengths
            runs.append(group.index.reshape(-1))
            first += runs[-1].numel()
        return cls(torch.cat(runs).to(torch.int64).contiguous(), offsets, lengths)


@dataclass
class KVView:
    """What one micro-batch's forward pass may do with one store: write `rows` (one cell per token), read the first
    `n_visible` cells. `groups` say which tokens read which of them; with `ordered`, a single group reads every
    visible cell in cell order, so torch's attention takes them as they lie, masked by that group's mask."""

    store: KVStore
    rows: torch.Tensor          # the cells this step's tokens are written to, one per token
    n_visible: int              # cells 0 .. n_visible-1 are read by attention
    groups: list[AttentionGroup]
    ordered: bool = False
    device_cells: TokenCells | None = None  # token_cells, made on the host and copied, where the store is on a GPU
    _device_groups: list[AttentionGroup] | None = field(default=None, repr=False)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.store.write(layer, self.rows, k, v)

    def layer_view(self, layer: int) -> tuple[KVView, int]:
        """The view layer `layer` attends through (this one), and its index in the store."""
        return self, layer

    def recurrent(self, layer: int) -> LayerState:
        raise TypeError(f"layer {layer} asks for a recurrent state from a memory of K/V rows only")

    @functools.cached_property
    def token_cells(self) -> TokenCells:
        """The cells each token reads, for the native attention: the same for every layer of the view, so found
        once."""
        return self.device_cells or TokenCells.of(self.groups, len(self.rows))

    @functools.cached_property
    def per_token(self) -> bool:
        """Whether every token reads rows of its own (decode tokens, short runs of guesses), no prompt chunk
        sharing its sequence's rows."""
        return all(group.index.dim() == 2 or len(group.tokens) == 1 for group in self.groups)

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.read(layer, self.n_visible)

    def groups_on(self, device: torch.device) -> list[AttentionGroup]:
        """The groups (made on the host) where attention reads them: copied once, and only by torch's attention
        (a GPU's kernel reads `token_cells`; a group's mask over every visible cell is large)."""
        if device.type == "cpu":
            return self.groups
        if self._device_groups is None:
            self._device_groups = [group.to(device) for group in self.groups]
        return self._device_groups


@dataclass
class LayerViews:
    """A view per layer, for models whose layers see different memory (sliding-window and full attention, in one
    pool or in two; attention and recurrent layers): layer i goes through `by_layer[i] = (view, its index there)`."""

    by_layer: list[tuple[object, int]]

    def recurrent(self, layer: int) -> LayerState:
        """A recurrent layer's state for this micro-batch (see kvlm.memory.recurrent)."""
        view, local = self.by_layer[layer]
        return view.recurrent(local)

    def layer_view(self, layer: int) -> tuple[object, int]:
        """The view layer `layer` attends through, and its index in that view's store."""
        return self.by_layer[layer]
