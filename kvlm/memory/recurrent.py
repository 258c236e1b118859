"""llama.cpp's recurrent memory: one state slot per sequence (a convolution's last inputs, an SSM state), no
per-token cells.

A slot holds the state after the sequence's positions first..last, as a whole: it cannot forget its last
tokens. So seq_rm answers False for a part of a sequence (as llama.cpp does) and only removes whole sequences;
seq_cp copies the state; a position shift is refused (there are no positions in a state to move). A batch's
micro-batches give each of their sequences the same number of tokens, laid out sequence by sequence, so a layer
sees its tokens as [n_seqs, n_tokens].

Each slot has two banks per layer: the one holding its committed state and the other, where a batch writes the new
state (write-before-commit: a failed batch leaves the committed one as it was). A later micro-batch of the batch
reads and steps the new state where it was written; the commit flips which bank is current, a roll back flips
nothing. So no state is ever copied to be kept or put back, and the native kernels read and write the banks in
place (`LayerState.in_place`): at 32 sequences of Qwen3.5-0.8B, 1.7 GB a step not gathered, allocated and copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvlm.core.batch import InvalidBatch
from kvlm.core.errors import CacheError
from kvlm.core.config import ModelConfig
from kvlm.core.states import StatesInPlace
from kvlm.memory.seq_state import load_sequence, save_sequence

EMPTY = -1
BANKS = 2


@dataclass
class RecurrentView:
    """The states one micro-batch's sequences read and replace, layer by layer."""

    memory: RecurrentMemory
    slots: torch.Tensor  # [n_seqs]: the slot of each sequence, in the micro-batch's order (the memory's device)
    seqs: np.ndarray     # the same slots on the host
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
        return len(self.view.seqs), self.view.n_tokens

    def read(self) -> list[torch.Tensor]:
        """This layer's state tensors of the micro-batch's sequences, [n_seqs, ...] each (not to be modified):
        the committed state, or the one an earlier micro-batch of this batch wrote."""
        memory, run = self.view.memory, self.view.run
        banks = self._reading()
        if run is not None and (banks == banks[0]).all():
            return [bank[int(banks[0]), run] for bank in memory.banks[self.layer]]
        index = torch.from_numpy(banks).to(self.view.slots.device)
        return [bank[index, self.view.slots] for bank in memory.banks[self.layer]]

    def in_place(self) -> list[StatesInPlace]:
        """This layer's state tensors where they lie, for kernels that read each sequence's state and write its new
        one themselves; `write` then takes what they return."""
        memory, seqs = self.view.memory, self.view.seqs
        sources = self._reading() * memory.n_seq_max + seqs  # bank * slots + slot
        targets = (1 - memory.current[self.layer, seqs]) * memory.n_seq_max + seqs
        return [StatesInPlace((len(seqs), *shape), dtype, torch.from_numpy(base + sources * size),
                              torch.from_numpy(base + targets * size))
                for base, size, shape, dtype in memory.bank_addresses[self.layer]]

    def write(self, new: list) -> None:
        """The states after this micro-batch, into the banks the commit makes current: tensors [n_seqs, ...] are
        copied there; what `in_place` handed out was written there already."""
        memory, seqs = self.view.memory, self.view.seqs
        targets = None
        for bank, value in zip(memory.banks[self.layer], new):
            if isinstance(value, StatesInPlace):
                continue
            if targets is None:
                targets = torch.from_numpy(1 - memory.current[self.layer, seqs]).to(bank.device)
            bank[targets, self.view.slots] = value.to(bank.dtype)
        memory.written[self.layer, seqs] = True

    def _reading(self) -> np.ndarray:
        """The bank each sequence reads: the committed one, or the other where this batch wrote the state."""
        memory, seqs = self.view.memory, self.view.seqs
        return memory.current[self.layer, seqs] ^ memory.written[self.layer, seqs]


class RecurrentMemory:
    kind = "recurrent"

    def __init__(self, config: ModelConfig, n_seq_max: int, state_shapes: list[list[tuple[int, ...]]]) -> None:
        """`state_shapes[i]`: the shapes of the i-th recurrent layer's state tensors for one sequence (float32)."""
        self.config = config
        self.n_seq_max = n_seq_max
        # banks[layer][i][b, slot]: the layer's i-th state tensor of a slot in bank b
        self.banks = [[torch.zeros(BANKS, n_seq_max, *shape) for shape in shapes] for shapes in state_shapes]
        # per layer, per state tensor: (its address, a slot's bytes, a slot's shape, dtype), for in_place
        self.bank_addresses = [[(bank.data_ptr(), bank[0, 0].numel() * bank.element_size(), tuple(bank.shape[2:]),
                                 bank.dtype) for bank in banks] for banks in self.banks]
        self.current = np.zeros((len(state_shapes), n_seq_max), dtype=np.int64)  # the bank of the committed state
        self.written = np.zeros((len(state_shapes), n_seq_max), dtype=bool)  # this batch's new state in the other
        self.first = np.full(n_seq_max, EMPTY, dtype=np.int64)  # per slot (= sequence id): its first position
        self.last = np.full(n_seq_max, EMPTY, dtype=np.int64)
        self._undo: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def pools(self) -> tuple:
        return ()

    @property
    def n_layer(self) -> int:
        """The recurrent layers."""
        return len(self.banks)

    @property
    def n_cells(self) -> int:
        return self.n_seq_max

    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.last >= 0))

    @property
    def kv_bytes(self) -> int:
        """The bytes of every slot's two banks (named as the KV kinds' for the reports that add them up)."""
        return sum(bank.numel() * bank.element_size() for layer in self.banks for bank in layer)

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
        for source, target in zip(self.committed(src), self.committed(dst)):
            for state, copy in zip(source, target):
                copy.copy_(state)
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
        return [int(self.first[slot]), int(self.last[slot])], [s.clone() for layer in self.committed(slot) for s in layer]

    def check_parts(self, span: list[int], parts: list[torch.Tensor], dest_seq_id: int) -> None:
        slot = self._slot(dest_seq_id)
        if self.last[slot] >= 0:
            raise CacheError(f"destination sequence {dest_seq_id} is not empty "
                             f"(positions {self.first[slot]}..{self.last[slot]})")
        expected = [] if span[1] < 0 else [(s.dtype, tuple(s.shape[2:])) for layer in self.banks for s in layer]
        if [(p.dtype, tuple(p.shape)) for p in parts] != expected:
            raise CacheError(f"recurrent state tensors {[tuple(p.shape) for p in parts]} do not fit this memory's "
                             f"{[shape for _, shape in expected]}")

    def load_parts(self, span: list[int], parts: list[torch.Tensor], dest_seq_id: int) -> None:
        slot = self._slot(dest_seq_id)
        for state, part in zip((s for layer in self.committed(slot) for s in layer), parts):
            state.copy_(part)
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
                for layer in self.committed(seq):
                    for state in layer:
                        state.zero_()
                self.first[seq] = ubatch.pos[owners == seq][0]
            self.last[seq] = ubatch.pos[owners == seq][-1]
        ascending = len(seqs) == 1 or bool(np.all(np.diff(seqs) == 1))
        run = slice(int(seqs[0]), int(seqs[-1]) + 1) if ascending else None
        device = self.banks[0][0].device if self.banks else None  # (a GPU's, where the memory was made there)
        seqs = seqs.copy()
        return RecurrentView(self, torch.from_numpy(seqs).to(device), seqs, n_tokens, run)

    def commit(self) -> None:
        """The batch's new states become the committed ones: the banks they were written to turn current."""
        self.current ^= self.written
        self.written.fill(False)
        self._undo = None

    def roll_back(self) -> None:
        self.first[:], self.last[:] = self._undo
        self.written.fill(False)
        self._undo = None

    def committed(self, slot: int) -> list[list[torch.Tensor]]:
        """Each layer's committed state tensors of a slot, as views into its current bank."""
        return [[bank[int(self.current[layer, slot]), slot] for bank in banks] for layer, banks in enumerate(self.banks)]

    def _slot(self, seq_id: int) -> int:
        if not 0 <= int(seq_id) < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} is outside [0, {self.n_seq_max})")
        return int(seq_id)

    def _refuse_shift(self, seq_id: int) -> None:
        self._slot(seq_id)
        raise CacheError("a recurrent state has no positions to shift: context shift (seq_add, seq_div) is not "
                         "possible for models with recurrent layers")
