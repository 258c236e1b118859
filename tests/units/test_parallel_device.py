"""Tensor parallelism's choices for a GPU model (NCCL between GPUs, a GPU per rank), on this machine without one:
what can be checked before any process starts."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from kvlm.parallel.follower import follow
from kvlm.parallel.group import collective_backend, start_local_group


def test_gpus_all_reduce_through_nccl_and_cpus_through_gloo():
    assert collective_backend("cuda") == "nccl"
    assert collective_backend("cpu") == "gloo"


def test_a_gpu_group_without_a_gpu_per_rank_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"a GPU per rank: 2 ranks on this host, 1 GPU\(s\) seen"):
        start_local_group(2, follow, "cuda")
    assert not dist.is_initialized()
