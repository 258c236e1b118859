"""The process group of a tensor-parallel model: starting it, watching it, and stopping all of it at once.

kvlm starts its own workers on one host (torch.multiprocessing, rendezvous through a TCPStore on 127.0.0.1), or
joins the group torchrun made (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment) on one host or
many. Rank 0 is the leader (kvlm.parallel.leader); the others follow it (kvlm.parallel.follower).

Two groups over the same ranks: the default one carries the all-reduces and times out after
KVLM_TP_TIMEOUT seconds (a rank that hangs stops the whole model); the control group carries rank 0's messages,
for which followers wait as long as rank 0 is idle.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlm.errors import KvlmError

log = logging.getLogger("kvlm")

COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("KVLM_TP_TIMEOUT", "120")))
IDLE_TIMEOUT = timedelta(days=365)
BACKEND = "gloo"  # kvlm's tensors live on the CPU; NCCL carries only CUDA tensors
PR_SET_PDEATHSIG = 1


class TensorParallelError(KvlmError):
    """A rank of a tensor-parallel model died or stopped answering; the whole group is stopped."""


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def torchrun_rank() -> int:
    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


def join_torchrun_group(size: int) -> dist.ProcessGroup:
    """This process's place in the group torchrun launched: the world must be the tensor-parallel size."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size {size} does not match torchrun's WORLD_SIZE {world}: kvlm uses every "
                         f"rank of the group for one model")
    if dist.is_initialized():
        raise ValueError("a process group is already running in this process: one tensor-parallel model per process")
    dist.init_process_group(BACKEND, init_method="env://", timeout=COLLECTIVE_TIMEOUT)
    _share_cores(int(os.environ.get("LOCAL_WORLD_SIZE", size)))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def start_local_group(size: int, follower_main) -> tuple[dist.ProcessGroup, mp.ProcessContext]:
    """Spawn ranks 1..size-1 on this host, each running follower_main(rank, store port); join them as rank 0."""
    if dist.is_initialized():
        raise ValueError("a process group is already running in this process: one tensor-parallel model per process")
    store = dist.TCPStore("127.0.0.1", 0, world_size=size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)
    workers = mp.start_processes(_local_rank, args=(store.port, size, follower_main), nprocs=size - 1, join=False,
                                 daemon=True, start_method="spawn")
    log.info("tensor parallel: %d ranks on this host, gloo; workers are pids %s", size,
             ", ".join(map(str, workers.pids())))
    dist.init_process_group(BACKEND, store=store, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    _share_cores(size)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), workers


def _local_rank(index: int, port: int, size: int, follower_main) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal's group: rank 0 decides
    store = dist.TCPStore("127.0.0.1", port, world_size=size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(BACKEND, store=store, rank=index + 1, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    _share_cores(size)
    follower_main(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


def _share_cores(ranks_on_this_host: int) -> None:
    """Each rank gets its share of this host's cores: more threads than cores would slow every rank down."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // ranks_on_this_host))


def _die_with_parent() -> None:
    """A worker whose parent dies is killed by the kernel, even if the parent had no time to stop it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # elsewhere, the closed connection to rank 0 ends the worker


def rank_statuses(workers: mp.ProcessContext | None) -> str:
    """What became of each local worker: 'rank 1 (pid 123) was killed by SIGKILL'."""
    if workers is None:
        return "see the other ranks' logs (launched by torchrun)"
    return "; ".join(f"rank {index + 1} (pid {process.pid}) {_fate(process.exitcode)}"
                     for index, process in enumerate(workers.processes))


def _fate(exitcode: int | None) -> str:
    if exitcode is None:
        return "is running but did not answer"
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def stop_workers(workers: mp.ProcessContext | None, grace_s: float) -> None:
    """Wait up to grace_s for the workers to end by themselves, then kill the rest and reap them all."""
    if workers is None:
        return
    for process in workers.processes:
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join()
