"""A recurrent state handed to kernels where the memory keeps it, instead of gathered into a tensor of its own."""
from __future__ import annotations

from typing import NamedTuple

import torch


class StatesInPlace(NamedTuple):  # a tuple: made for every recurrent layer of every step, so made cheaply
    """One state tensor of a micro-batch's sequences as the memory keeps it (kvlm.memory.recurrent: two banks per
    slot): sequence i's state is read at address sources[i] and its new state written at targets[i], each a
    contiguous tensor of shape[1:] in `dtype` that the memory keeps alive. A source may be its own target (a later
    micro-batch of a batch stepping a state an earlier one wrote): kernels read every value before writing it."""

    shape: tuple[int, ...]  # [n_seq, *one sequence's state]
    dtype: torch.dtype
    sources: torch.Tensor  # [n_seq] int64 addresses
    targets: torch.Tensor
