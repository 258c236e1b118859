"""A KV cache for one sequence: rows 0..length-1 hold positions 0..length-1."""
from __future__ import annotations

import torch

from kvlm.errors import CacheError
from kvlm.loader.config import ModelConfig
from kvlm.memory.kv_store import KVStore
from kvlm.memory.view import KVView
from kvlm.model.ops import causal_mask


class SequenceCache:
    """The visible length only grows in `commit`, after every layer wrote the new rows."""

    def __init__(self, config: ModelConfig, max_context: int, dtype: str = "f32") -> None:
        self.store = KVStore(config, max_context, dtype)
        self.length = 0

    @property
    def max_context(self) -> int:
        return self.store.n_cells

    @property
    def kv_bytes(self) -> int:
        return self.store.kv_bytes

    def prefill_view(self, n_tokens: int) -> KVView:
        """Rows for n_tokens appended after the cached ones, with a causal mask."""
        self._check_room(self.length, n_tokens)
        rows = torch.arange(self.length, self.length + n_tokens)
        mask = causal_mask(n_tokens, self.length, torch.float32) if n_tokens > 1 else None
        return KVView(self.store, rows, self.length + n_tokens, mask)

    def decode_view(self, kv_pos: torch.Tensor) -> KVView:
        """The row of one new token at position kv_pos; it attends over rows 0..kv_pos."""
        pos = int(kv_pos.reshape(-1)[0])
        if pos != self.length:
            raise CacheError(f"decode at kv_pos {pos}, but the cache holds {self.length} positions")
        self._check_room(pos, 1)
        return KVView(self.store, kv_pos.reshape(1), pos + 1, None)

    def commit(self, n_tokens: int) -> None:
        self.length += n_tokens

    def reset(self) -> None:
        """Forget every position; the allocation stays for the next sequence."""
        self.length = 0

    def _check_room(self, start: int, n_tokens: int) -> None:
        if n_tokens <= 0:
            raise CacheError(f"nothing to write: {n_tokens} tokens")
        if start + n_tokens > self.max_context:
            raise CacheError(
                f"writing {n_tokens} tokens at position {start} needs {start + n_tokens} rows, "
                f"but max_context is {self.max_context}"
            )
