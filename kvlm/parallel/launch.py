"""Bringing up a tensor-parallel model: check the size, start or join the ranks, load every rank's shard."""
from __future__ import annotations

import torch.distributed as dist

from kvlm.fetch import resolve_model
from kvlm.load import Model, load_summary
from kvlm.model.settings import ComputeSettings
from kvlm.parallel.follower import follow
from kvlm.parallel.group import join_torchrun_group, launched_by_torchrun, start_local_group
from kvlm.parallel.leader import Leader, LeaderDecoder
from kvlm.parallel.shard import check_size, check_tensor_parallel, load_shard


def load_tensor_parallel(spec: str, size: int, settings: ComputeSettings, fetch: bool, progress: bool) -> Model:
    """Rank 0's model, its decoder running every pass with the other ranks.

    Under torchrun, every rank runs the same program: ranks other than 0 serve rank 0 from here until it stops,
    then exit.
    """
    check_size(size)
    resolve_model(spec, fetch=fetch, progress=progress)
    check_tensor_parallel(load_summary(spec, fetch=False)[0], size)  # before any weight is read
    if launched_by_torchrun():
        control, workers, shared_file = join_torchrun_group(size), None, None
        if dist.get_rank() > 0:
            follow(control)
            raise SystemExit(0)
    else:
        control, workers, shared_file = start_local_group(size, follow)
    leader = Leader(size, control, workers, shared_file)
    try:
        leader.send(("load", spec, size, settings))
        model = load_shard(spec, 0, size, settings)
        model.decoder = LeaderDecoder(model.decoder, leader)  # maps the shared file: before the barrier removes it
        leader.barrier()
    except BaseException:
        leader.stop()
        raise
    model.tensor_parallel = leader
    return model
