"""Reuse of computed prompt prefixes: full blocks of tokens whose cells a reserved sequence keeps alive.

A block is identified by a hash of every token from position 0 to its end, so a match is always a whole
prefix. The cache owns nothing but a sequence id: inserting a block adds the owner to the cells that
hold it, lending it adds the request's sequence to the same cells, and evicting it removes the owner
(cells still used by a running request stay; the others are freed). No K/V is ever copied.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from kvlm.memory.cells import Cells


class PrefixCache:
    def __init__(self, cells: Cells, owner_seq: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.cells = cells
        self.owner_seq = owner_seq
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()  # least recently used first
        self.hit_tokens = 0

    def match(self, tokens: list[int]) -> np.ndarray:
        """Cells of the longest cached prefix of `tokens`, leaving at least the last token to compute.

        The last token must run through the model to give the logits of the next one, so a prompt that
        is cached in full still gets its final block computed (minus what the cap allows).
        """
        found = []
        for key in self._keys(tokens[: max(len(tokens) - 1, 0)]):
            cells = self._blocks.get(key)
            if cells is None:
                break
            found.append((key, cells))
        for key, _ in reversed(found):  # parents end up more recent than children: evicted last
            self._blocks.move_to_end(key)
        return np.concatenate([cells for _, cells in found]) if found else np.empty(0, dtype=np.int64)

    def lend(self, cells: np.ndarray, seq_id: int) -> None:
        if cells.size:
            self.cells.share(cells, seq_id)
            self.hit_tokens += int(cells.size)

    def insert(self, tokens: list[int], seq_cells: np.ndarray) -> None:
        """Remember the full blocks of a computed sequence: `seq_cells[i]` holds `tokens[i]` at position i."""
        for index, key in enumerate(self._keys(tokens)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            cells = seq_cells[index * self.block_size : (index + 1) * self.block_size]
            self.cells.share(cells, self.owner_seq)
            self._blocks[key] = cells

    def evict(self, n_cells: int) -> int:
        """Drop least recently used blocks until n_cells cells were freed or nothing is left."""
        freed = 0
        while freed < n_cells and self._blocks:
            _, cells = self._blocks.popitem(last=False)
            freed += self.cells.unshare(cells, self.owner_seq)
        return freed

    def clear(self) -> None:
        self.evict(self.cells.n_cells)

    def _keys(self, tokens: list[int]):
        """One key per full block: a running hash over every token up to the block's end."""
        digest = hashlib.sha256()
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            digest.update(np.asarray(tokens[end - self.block_size : end], dtype=np.int64).tobytes())
            yield digest.copy().digest()
