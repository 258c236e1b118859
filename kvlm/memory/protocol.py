"""The memory protocol (after llama.cpp's llama_memory_i): an interface only (kvlm.memory.layout decides which
memory a model gets).

Context and the engine talk only to this protocol. A decode plans the whole batch as a dry run (nothing changes
if it does not fit), then for each micro-batch `place`s it and runs the forward pass through the view it gets,
then `commit`s, or `roll_back`s to exactly the state before the batch. A kind that cannot do an operation says
so (seq_rm answers False; other operations raise CacheError) and changes nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvlm.memory.memory import KVMemory
    from kvlm.memory.view import MemoryView


class Memory(Protocol):
    kind: str  # "unified", "iswa", "recurrent" or "hybrid"

    @property
    def pools(self) -> tuple[KVMemory, ...]:
        """Its pools of cells, each with its own cells, K/V store and sliding `window` (0: every position)."""

    @property
    def n_cells(self) -> int: ...
    @property
    def n_used(self) -> int: ...
    @property
    def kv_bytes(self) -> int: ...

    def cells_short(self, n_tokens: int) -> int:
        """How many cells are missing for n_tokens more tokens (0: they fit)."""

    def retain(self, seq_id: int) -> None:
        """seq_id holds cells for others (a prefix cache): never pruned, its window never checked."""

    def share(self, block: list, seq_id: int) -> None:
        """Add seq_id to used cells, named per pool (a prefix cache lending a block)."""
    def unshare(self, block: list, seq_id: int) -> None:
        """Remove seq_id from those cells; cells left without a sequence are freed."""

    # sequence operations, as llama.cpp's
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_keep(self, seq_id: int) -> None: ...
    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def clear(self) -> None: ...
    def compact(self) -> None: ...
    def state_seq_save(self, seq_id: int) -> bytes: ...
    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None: ...

    # speculative decoding: taking guessed tokens back
    def checkpoint(self, seq_id: int) -> object:
        """What `restore` needs to put the sequence back as it is now, when seq_rm cannot remove a tail of it
        (a recurrent state); None for the KV kinds, whose tails seq_rm removes."""
    def restore(self, checkpoint: object) -> None: ...

    # a batch
    def apply_shifts(self) -> None: ...
    def split(self, batch, n_ubatch: int) -> list:
        """The batch's micro-batches: in order (KV kinds), or as many tokens per sequence in each (recurrent)."""
    def plan(self, ubatches) -> list | None:
        """Where each micro-batch goes; None if it does not fit; InvalidBatch for what the kind cannot take."""
    def begin(self) -> None: ...
    def place(self, ubatch, slot) -> MemoryView: ...
    def commit(self) -> None: ...
    def roll_back(self) -> None: ...

