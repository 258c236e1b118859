"""Prefix reuse for memories with recurrent states (recurrent, hybrid): copies of a sequence's states at block
boundaries, kept by the hash of the prefix they hold.

A recurrent state holds its whole sequence as one value: no prefix of it can be lent as K/V cells are. So the engine
copies a running sequence's states whenever a step leaves it at a block boundary (the scheduler ends a prompt's
chunk at the prompt's last boundary before its end, so that one exists), keeps that copy and the last one before
the request ends, and a later request whose prompt extends one of those prefixes starts from the
copy (with, in a hybrid memory, the prefix cache's K/V cells of the same tokens) instead of from position 0. The
native recurrent kernels step each token in order with the same float32 operations wherever a prompt is cut, so
the state restored is the state a full recompute gives, bit for bit, and so is everything after it.

Memory: at most `capacity` states (each sequence's latest copy and the kept ones), the least recently used kept
copy evicted first; counted in the memory plan (`checkpoint_capacity`, MemoryRequest.state_checkpoints).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvlm.engine.prefix_cache import prefix_keys


def checkpoint_capacity(max_num_seqs: int) -> int:
    """States kept for an engine of max_num_seqs requests: each running request's latest copy, and as many kept (a
    conversation's prompt boundary and its end, for each of that many conversations, minus what runs)."""
    return 2 * max_num_seqs


@dataclass
class StateCheckpoint:
    n_tokens: int                # the positions 0 .. n_tokens - 1 it holds
    parts: list[torch.Tensor]    # the memory's state tensors of one sequence (RecurrentMemory.state_parts)


class StateCheckpoints:
    def __init__(self, memory, block_size: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 state, got {capacity}")
        self.memory = memory
        self.block_size = block_size
        self.capacity = capacity
        self._kept: OrderedDict[bytes, StateCheckpoint] = OrderedDict()  # least recently used first
        self._latest: dict[int, StateCheckpoint] = {}  # per running sequence: its last boundary's copy

    @property
    def n_states(self) -> int:
        return len(self._held())

    @property
    def n_bytes(self) -> int:
        return sum(part.numel() * part.element_size() for c in self._held() for part in c.parts)

    def _held(self) -> list[StateCheckpoint]:
        """The distinct copies held (a kept copy may still be its sequence's latest)."""
        return list({id(c): c for c in [*self._kept.values(), *self._latest.values()]}.values())

    def prompt_chunk(self, n_computed: int, n_tokens: int, n_held: int) -> int:
        """A prompt chunk's length, cut to end at the last block boundary before the end of the sequence's `n_held`
        tokens where it would run past it (so the state there exists to be copied). Before the end, not at it: the
        same prompt again must compute its last token, so it can only start from a copy short of it."""
        boundary = (n_held - 1) // self.block_size * self.block_size
        return boundary - n_computed if n_computed < boundary < n_computed + n_tokens else n_tokens

    def after_step(self, seq_id: int, n_computed: int) -> None:
        """Copy the sequence's states if its committed tokens now end at a block boundary."""
        if n_computed and n_computed % self.block_size == 0:
            _, span, parts = self.memory.checkpoint(seq_id)
            assert span[1] == n_computed - 1, (span, n_computed)  # the memory holds exactly the committed tokens
            self._latest[seq_id] = StateCheckpoint(n_computed, parts)
            self._fit()

    def keep(self, tokens: list[int], seq_id: int) -> None:
        """Keep the sequence's latest copy for later requests; `tokens`: what its positions hold."""
        latest = self._latest.get(seq_id)
        if latest is None or latest.n_tokens > len(tokens):
            return
        *_, key = prefix_keys(tokens[: latest.n_tokens], self.block_size)
        self._kept[key] = latest
        self._kept.move_to_end(key)
        self._fit()

    def forget(self, seq_id: int) -> None:
        """The sequence is gone: its latest copy goes too, unless kept."""
        self._latest.pop(seq_id, None)

    def deepest(self, tokens: list[int], limit: int) -> StateCheckpoint | None:
        """The kept copy of the longest prefix of `tokens` of at most `limit` tokens, if any."""
        found = None
        for key in prefix_keys(tokens[: max(limit, 0)], self.block_size):
            checkpoint = self._kept.get(key)
            if checkpoint is not None:
                self._kept.move_to_end(key)  # the deepest ends up the most recent
                found = checkpoint
        return found

    def restore(self, checkpoint: StateCheckpoint, seq_id: int) -> int:
        """Give the (empty) sequence the copy's states; returns how many positions they hold."""
        self.memory.restore((seq_id, [0, checkpoint.n_tokens - 1], checkpoint.parts))
        return checkpoint.n_tokens

    def clear(self) -> None:
        self._kept.clear()

    def _fit(self) -> None:
        while self.n_states > self.capacity and self._kept:
            self._kept.popitem(last=False)
