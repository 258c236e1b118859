"""Ranks 1..N-1 of a tensor-parallel model: load this rank's shard with the function rank 0 sends, then repeat
rank 0's memory calls and run its forward passes (see kvlm.parallel.leader) until it says stop."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from kvlm.memory.layout import memory_for
from kvlm.parallel.collectives import make_collectives, vocab_shares
from kvlm.parallel.group import COLLECTIVE_TIMEOUT, loaded_barrier

log = logging.getLogger("kvlm")


def follow(control: dist.ProcessGroup, shared_file: Path | None = None) -> None:
    """`shared_file`: the collectives go through it (ranks on one host), else through gloo."""
    rank = dist.get_rank()
    try:
        _, load = _receive(control)[0]
        decoder = load(rank).decoder
        wire = make_collectives(rank, vocab_shares(decoder.config.vocab_size, dist.get_world_size()), shared_file,
                                COLLECTIVE_TIMEOUT.total_seconds())
        decoder.all_reduce, decoder.gather_logits = wire.all_reduce, wire.gather_vocab
        loaded_barrier(control)
        Follower(decoder, control).run()
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _receive(control: dist.ProcessGroup) -> list[tuple]:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


class Follower:
    def __init__(self, decoder, control: dist.ProcessGroup) -> None:
        self.decoder, self.control = decoder, control
        self.memories = {}
        self.view = None  # what the last `place` returned: the next forward pass reads and writes through it

    def run(self) -> None:
        while True:
            for name, *args in _receive(self.control):
                if name == "stop":
                    return
                getattr(self, f"_{name}")(*args)

    def _memory(self, memory_id: int, sizes: dict) -> None:
        self.memories[memory_id] = memory_for(self.decoder, **sizes)

    def _drop(self, memory_id: int) -> None:
        del self.memories[memory_id]

    def _call(self, memory_id: int, name: str, args: tuple, kwargs: dict) -> None:
        result = getattr(self.memories[memory_id], name)(*args, **kwargs)
        if name == "place":
            self.view = result

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, output_rows: torch.Tensor | None) -> None:
        device = self.decoder.device  # (this rank's GPU, where it has one)
        output_rows = None if output_rows is None else output_rows.to(device)
        self.decoder.forward(tokens.to(device), positions, self.view, output_rows)  # its logits went to rank 0
        self.view = None

    def _save(self, memory_id: int, seq_id: int) -> None:
        dist.gather_object(self.memories[memory_id].state_seq_save(seq_id), None, dst=0)

    def _load(self, memory_id: int, parts: list[bytes], dest_seq_id: int) -> None:
        self.memories[memory_id].state_seq_load(parts[dist.get_rank()], dest_seq_id)
