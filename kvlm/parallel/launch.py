"""Bringing up a tensor-parallel model: start or join the ranks, have every rank load its part, wait for all.

What a rank loads is the caller's (kvlm.loader hands over its own function): this package knows processes and
collectives, not model files.
"""
from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from kvlm.parallel.follower import follow
from kvlm.parallel.group import (
    join_torchrun_group,
    launched_by_torchrun,
    start_local_group,
)
from kvlm.parallel.leader import Leader, LeaderDecoder


def launch_tensor_parallel(size: int, load: Callable[[int], object], device: str = "cpu"):
    """Rank 0's model (what load(0) returns, with a `decoder`), its decoder running every pass with the other
    ranks, each of which runs load(rank) (`load` must pickle: ranks may be other processes). `device` "cuda": a GPU
    per rank, the collectives through NCCL.

    Under torchrun, every rank runs the same program: ranks other than 0 serve rank 0 from here until it stops,
    then exit.
    """
    if launched_by_torchrun():
        control, workers, shared_file = join_torchrun_group(size, device), None, None
        if dist.get_rank() > 0:
            follow(control)
            raise SystemExit(0)
    else:
        control, workers, shared_file = start_local_group(size, follow, device)
    leader = Leader(size, control, workers, shared_file)
    try:
        leader.send(("load", load))
        model = load(0)
        model.decoder = LeaderDecoder(model.decoder, leader)  # maps the shared file: before the barrier removes it
        leader.barrier()
    except BaseException:
        leader.stop()
        raise
    model.tensor_parallel = leader
    return model
