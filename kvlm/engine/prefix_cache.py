"""Reuse of computed prompt prefixes: full blocks of tokens whose cells a reserved sequence keeps alive.

A block is identified by a hash of every token from position 0 to its end, so a match is always a whole
prefix. The cache owns nothing but a sequence id: inserting a block adds the owner to the cells that
hold it, lending it adds the request's sequence to the same cells, and evicting it removes the owner
(cells still used by a running request stay; the others are freed). No K/V is ever copied.

A memory with a sliding-window pool (iSWA) holds only each sequence's recent positions there, so a block may
have fewer cells in that pool than tokens. A prefix is lent only up to where the window before its end is
whole in every pool; beyond that its tokens are computed again.
"""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

log = logging.getLogger("kvlm")

Block = list[np.ndarray]  # per pool of the memory, the cells holding the block's positions there


class PrefixCache:
    def __init__(self, memory, owner_seq: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.memory = memory  # every change to cells goes through it (a tensor-parallel memory repeats them)
        self.pools = memory.pools
        self.owner_seq = owner_seq
        self.block_size = block_size
        memory.retain(owner_seq)
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.hit_tokens = 0

    def match(self, tokens: list[int]) -> list[Block]:
        """The blocks of the longest cached prefix of `tokens` that can be lent, leaving at least the last token
        to compute.

        The last token must run through the model to give the logits of the next one, so a prompt that
        is cached in full still gets its final block computed (minus what the cap allows).
        """
        found = []
        for key in self._keys(tokens[: max(len(tokens) - 1, 0)]):
            blocks = self._blocks.get(key)
            if blocks is None:
                break
            found.append((key, blocks))
        for key, _ in reversed(found):  # parents end up more recent than children: evicted last
            self._blocks.move_to_end(key)
        usable = len(found)
        while usable and not self._windows_whole([blocks for _, blocks in found[:usable]]):
            usable -= 1
        if usable < len(found):
            log.info("prefix cache: %d cached tokens match, %d can be lent (sliding-window cells before the rest "
                     "were freed); the others are computed again", len(found) * self.block_size,
                     usable * self.block_size)
        return [blocks for _, blocks in found[:usable]]

    def lend(self, blocks: list[Block], seq_id: int) -> int:
        """Let seq_id use the cells of these blocks; returns how many tokens they hold."""
        for block in blocks:
            self.memory.share(block, seq_id)
        n_tokens = len(blocks) * self.block_size
        self.hit_tokens += n_tokens
        return n_tokens

    def insert(self, tokens: list[int], seq_id: int) -> None:
        """Remember the full blocks of a computed sequence, whose position i holds `tokens[i]`."""
        for index, key in enumerate(self._keys(tokens)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            start = index * self.block_size
            block = [pool.cells.seq_cells_in(seq_id, start, start + self.block_size) for pool in self.pools]
            self.memory.share(block, self.owner_seq)
            self._blocks[key] = block

    def evict_until(self, enough: Callable[[], bool]) -> None:
        """Drop least recently used blocks until `enough()` or nothing is left."""
        while not enough() and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.memory.unshare(block, self.owner_seq)

    def clear(self) -> None:
        self.evict_until(lambda: False)

    def _windows_whole(self, blocks: list[Block]) -> bool:
        """Whether every pool holds each position the token after these blocks sees (its window, or all)."""
        end = len(blocks) * self.block_size
        for index, pool in enumerate(self.pools):
            first = max(0, end - pool.window + 1) if pool.window else 0
            held = np.concatenate([block[index] for block in blocks])
            if np.count_nonzero(pool.cells.pos[held] >= first) < end - first:
                return False
        return True

    def _keys(self, tokens: list[int]):
        return prefix_keys(tokens, self.block_size)


def prefix_keys(tokens: list[int], block_size: int):
    """One key per full block of `tokens`: a running hash over every token up to the block's end (so equal keys
    mean equal prefixes)."""
    digest = hashlib.sha256()
    for end in range(block_size, len(tokens) + 1, block_size):
        digest.update(np.asarray(tokens[end - block_size : end], dtype=np.int64).tobytes())
        yield digest.copy().digest()
