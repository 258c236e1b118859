"""llama.cpp's recurrent memory: one state slot per sequence (a convolution's last inputs, an SSM state), no
per-token cells.

A slot holds the state after the sequence's positions first..last, as a whole: it cannot forget its last
tokens. So seq_rm answers False for a part of a sequence (as llama.cpp does) and only removes whole sequences;
seq_cp copies the state; a position shift is refused (there are no positions in a state to move). A batch's
micro-batches give each of their sequences the same number of tokens, laid out sequence by sequence, so a layer
sees its tokens as [n_seqs, n_tokens]. New states stay pending until the batch commits (a later micro-batch of
the batch reads them from there), so a failed batch only drops them: no state is copied to be put back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvlm.core.batch import InvalidBatch
from kvlm.core.errors import CacheError
from kvlm.core.config import ModelConfig
from kvlm.memory.seq_state import load_sequence, save_sequence

EMPTY = -1


@dataclass
class RecurrentView:
    """The states one micro-batch's sequences read and replace, layer by layer."""

    memory: RecurrentMemory
    slots: torch.Tensor  # [n_seqs]: the slot of each sequence, in the micro-batch's order
    n_tokens: int        # tokens per sequence
    run: slice | None    # the same slots as one ascending run, which reads as a view instead of a copy

    def recurrent(self, layer: int) -> LayerState:
        return LayerState(self, layer)

    def layer_view(self, layer: int):
        raise TypeError(f"layer {layer} asks for K/V rows from a memory of recurrent states only")


@dataclass
class LayerState:
    view: RecurrentView
    layer: int

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.view.slots), self.view.n_tokens

    def read(self) -> list[torch.Tensor]:
        """This layer's state tensors of the micro-batch's sequences, [n_seqs, ...] each (not to be modified):
        what the memory holds, or what an earlier micro-batch of this batch left pending."""
        slots, memory = self.view.slots, self.view.memory
        states = [state[self.view.run] if self.view.run else state.index_select(0, slots)
                  for state in memory.states[self.layer]]
        for pending_slots, pending in memory.pending[self.layer]:
            mine, theirs = (slots[:, None] == pending_slots[None, :]).nonzero(as_tuple=True)
            if mine.numel():
                states = [state.clone() if self.view.run else state for state in states]
                for state, value in zip(states, pending):
                    state[mine] = value[theirs].to(state.dtype)
        return states

    def write(self, new: list[torch.Tensor]) -> None:
        """The states after this micro-batch: pending until the batch commits."""
        self.view.memory.pending[self.layer].append((self.view.slots, new))


class RecurrentMemory:
    kind = "recurrent"

    def __init__(self, config: ModelConfig, n_seq_max: int, state_shapes: list[list[tuple[int, ...]]]) -> None:
        """`state_shapes[i]`: the shapes of the i-th recurrent layer's state tensors for one sequence (float32)."""
        self.config = config
        self.n_seq_max = n_seq_max
        self.states = [[torch.zeros(n_seq_max, *shape) for shape in shapes] for shapes in state_shapes]
        self.first = np.full(n_seq_max, EMPTY, dtype=np.int64)  # per slot (= sequence id): its first position
        self.last = np.full(n_seq_max, EMPTY, dtype=np.int64)
        self.pending: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = [[] for _ in state_shapes]
        self._undo: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def pools(self) -> tuple:
        return ()

    @property
    def n_cells(self) -> int:
        return self.n_seq_max

    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.last >= 0))

    @property
    def kv_bytes(self) -> int:
        """The bytes of every slot's state (named as the KV kinds' for the reports that add them up)."""
        return sum(state.numel() * state.element_size() for layer in self.states for state in layer)

    def cells_short(self, n_tokens: int) -> int:
        return 0  # one slot per sequence id, whatever its length

    def retain(self, seq_id: int) -> None:
        """Nothing to keep: a recurrent memory holds no prefix for others."""

    # --- sequence operations ---
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions [p0, p1) (p0 < 0: 0, p1 < 0: all); only nothing or a whole sequence can go."""
        p0, p1 = max(int(p0), 0), np.iinfo(np.int64).max if p1 < 0 else int(p1)
        slots = range(self.n_seq_max) if seq_id < 0 else [self._slot(seq_id)]
        held = [s for s in slots if self.last[s] >= 0 and p0 <= self.last[s] and p1 > self.first[s]]
        if any(p0 > self.first[s] or p1 <= self.last[s] for s in held):
            return False
        for slot in held:
            self.first[slot] = self.last[slot] = EMPTY
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Give dst a copy of src's state; the range must cover all of src."""
        src, dst = self._slot(src), self._slot(dst)
        p0, p1 = max(int(p0), 0), np.iinfo(np.int64).max if p1 < 0 else int(p1)
        if self.last[src] < 0 or src == dst:
            return
        if p0 > self.first[src] or p1 <= self.last[src]:
            raise CacheError(f"seq_cp({src}, {dst}, {p0}, {p1}): a recurrent state holds positions "
                             f"{self.first[src]}..{self.last[src]} as a whole and cannot be copied in part")
        for layer in self.states:
            for state in layer:
                state[dst] = state[src]
        self.first[dst], self.last[dst] = self.first[src], self.last[src]

    def seq_keep(self, seq_id: int) -> None:
        keep = self._slot(seq_id)
        others = np.arange(self.n_seq_max) != keep
        self.first[others] = self.last[others] = EMPTY

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self._refuse_shift(seq_id)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self._refuse_shift(seq_id)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(self.first[self._slot(seq_id)])

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self.last[self._slot(seq_id)])

    def clear(self) -> None:
        self.first.fill(EMPTY)
        self.last.fill(EMPTY)

    def compact(self) -> None:
        """Nothing to compact: a slot per sequence."""

    def state_seq_save(self, seq_id: int) -> bytes:
        return save_sequence((), seq_id, self)

    def state_seq_load(self, data: bytes, dest_seq_id: int) -> None:
        load_sequence((), data, dest_seq_id, self)

    def state_parts(self, seq_id: int) -> tuple[list[int], list[torch.Tensor]]:
        """[first, last] and the slot's state tensors, for a saved sequence state."""
        slot = self._slot(seq_id)
        if self.last[slot] < 0:
            return [EMPTY, EMPTY], []
        return [int(self.first[slot]), int(self.last[slot])], [s[slot].clone() for layer in self.states for s in layer]

    def check_parts(self, span: list[int], parts: list[torch.Tensor], dest_seq_id: int) -> None:
        slot = self._slot(dest_seq_id)
        if self.last[slot] >= 0:
            raise CacheError(f"destination sequence {dest_seq_id} is not empty "
                             f"(positions {self.first[slot]}..{self.last[slot]})")
        expected = [] if span[1] < 0 else [(s.dtype, tuple(s.shape[1:])) for layer in self.states for s in layer]
        if [(p.dtype, tuple(p.shape)) for p in parts] != expected:
            raise CacheError(f"recurrent state tensors {[tuple(p.shape) for p in parts]} do not fit this memory's "
                             f"{[shape for _, shape in expected]}")

    def load_parts(self, span: list[int], parts: list[torch.Tensor], dest_seq_id: int) -> None:
        slot = self._slot(dest_seq_id)
        states = [s for layer in self.states for s in layer]
        for state, part in zip(states, parts):
            state[slot] = part
        self.first[slot], self.last[slot] = span

    # --- speculative decoding: a state to return to when guessed tokens are rejected ---
    def checkpoint(self, seq_id: int) -> tuple:
        """A copy of the sequence's state as it is now (a state cannot forget tokens: seq_rm of a tail fails)."""
        return (seq_id, *self.state_parts(seq_id))

    def restore(self, checkpoint: tuple) -> None:
        """Put a sequence's state back as `checkpoint` took it (whatever it holds now)."""
        seq_id, span, parts = checkpoint
        self.load_parts(span, parts, seq_id)

    # --- a batch ---
    def apply_shifts(self) -> None:
        """No positions to shift in a state."""

    def split(self, batch, n_ubatch: int) -> list:
        return batch.split_equal(n_ubatch)

    def plan(self, ubatches) -> list[np.ndarray]:
        """Each micro-batch's sequences, one per token group; a token of several sequences is refused."""
        plans = []
        for ubatch in ubatches:
            shared = np.flatnonzero(ubatch.seq_mask.sum(axis=1) > 1)
            if shared.size:
                raise InvalidBatch(f"a token belongs to sequences {np.flatnonzero(ubatch.seq_mask[shared[0]]).tolist()}"
                                   ": a recurrent state takes each token in one sequence only")
            plans.append(ubatch.seq_mask.argmax(axis=1))
        return plans

    def begin(self) -> None:
        self._undo = (self.first.copy(), self.last.copy())

    def place(self, ubatch, owners: np.ndarray) -> RecurrentView:
        """Read the micro-batch's sequences as [n_seqs, n_tokens] (it is laid out so); a sequence that begins
        here starts from a zero state (its empty slot is cleared: nothing to put back)."""
        seqs = owners[:: len(owners) // len(np.unique(owners))]
        n_tokens = len(owners) // len(seqs)
        for seq in seqs.tolist():
            if self.last[seq] < 0:
                for layer in self.states:
                    for state in layer:
                        state[seq].zero_()
                self.first[seq] = ubatch.pos[owners == seq][0]
            self.last[seq] = ubatch.pos[owners == seq][-1]
        ascending = len(seqs) == 1 or bool(np.all(np.diff(seqs) == 1))
        run = slice(int(seqs[0]), int(seqs[-1]) + 1) if ascending else None
        device = self.states[0][0].device if self.states else None  # (a GPU's, where the memory was made there)
        return RecurrentView(self, torch.from_numpy(seqs.copy()).to(device), n_tokens, run)

    def commit(self) -> None:
        """Write the batch's new states, in micro-batch order."""
        for states, pending in zip(self.states, self.pending):
            for slots, new in pending:
                for state, value in zip(states, new):
                    state.index_copy_(0, slots, value.to(state.dtype))
            pending.clear()
        self._undo = None

    def roll_back(self) -> None:
        self.first[:], self.last[:] = self._undo
        for pending in self.pending:
            pending.clear()
        self._undo = None

    def _slot(self, seq_id: int) -> int:
        if not 0 <= int(seq_id) < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} is outside [0, {self.n_seq_max})")
        return int(seq_id)

    def _refuse_shift(self, seq_id: int) -> None:
        self._slot(seq_id)
        raise CacheError("a recurrent state has no positions to shift: context shift (seq_add, seq_div) is not "
                         "possible for models with recurrent layers")
