"""The process group of a tensor-parallel model: starting it, watching it, and stopping all of it at once.

kvlm starts its own workers on one host (torch.multiprocessing, rendezvous through a TCPStore on 127.0.0.1), or
joins the group torchrun made (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment) on one host or
many. Rank 0 is the leader (kvlm.parallel.leader); the others follow it (kvlm.parallel.follower).

Two groups over the same ranks: the default one times out after KVLM_TP_TIMEOUT seconds (a rank that hangs stops
the whole model) and carries the all-reduces (gloo's on CPUs, NCCL's between GPUs: each rank then takes the GPU of
its local rank), unless CPU ranks share a host that can take them through shared memory (kvlm.parallel.collectives,
same timeout); the control group (gloo) carries rank 0's messages, for which followers wait as long as rank 0 is
idle. Starting and loading get STARTUP_TIMEOUT; a worker that dies meanwhile
is reported at once.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlm.core.errors import KvlmError
from kvlm.parallel import collectives
from kvlm.startup import START_CPUS

log = logging.getLogger("kvlm")

COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("KVLM_TP_TIMEOUT", "120")))
IDLE_TIMEOUT = timedelta(days=365)
STARTUP_TIMEOUT = timedelta(minutes=10)  # for every rank to start and load its shard
PR_SET_PDEATHSIG = 1


class TensorParallelError(KvlmError):
    """A rank of a tensor-parallel model died or stopped answering; the whole group is stopped."""


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def collective_backend(device: str) -> str:
    """The default group's backend: NCCL between GPUs (it carries only CUDA tensors), gloo between CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def _take_gpu(local_rank: int, ranks_on_host: int) -> None:
    """A GPU rank's own GPU: its local rank's ("cuda" means it from here on)."""
    available = torch.cuda.device_count()
    if available < ranks_on_host:
        raise ValueError(f"tensor parallelism on cuda needs a GPU per rank: {ranks_on_host} ranks on this host, "
                         f"{available} GPU(s) seen")
    torch.cuda.set_device(local_rank)


def join_torchrun_group(size: int, device: str = "cpu") -> dist.ProcessGroup:
    """This process's place in the group torchrun launched: the world must be the tensor-parallel size."""
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size {size} does not match torchrun's WORLD_SIZE {world}: kvlm uses every "
                         f"rank of the group for one model")
    if dist.is_initialized():
        raise ValueError("a process group is already running in this process: one tensor-parallel model per process")
    local_rank, ranks_on_host = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if device == "cuda":
        _take_gpu(local_rank, ranks_on_host)
    dist.init_process_group(collective_backend(device), init_method="env://", timeout=COLLECTIVE_TIMEOUT)
    _pin(core_share(local_rank, ranks_on_host))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def start_local_group(size: int, follower_main, device: str = "cpu"
                      ) -> tuple[dist.ProcessGroup, mp.ProcessContext, Path | None]:
    """Spawn ranks 1..size-1 on this host, each running follower_main(control group, shared file); join them as
    rank 0. The shared file carries a CPU model's collectives (kvlm.parallel.collectives) where this host can have
    one; a GPU model's go through NCCL, rank r on GPU r."""
    if dist.is_initialized():
        raise ValueError("a process group is already running in this process: one tensor-parallel model per process")
    if device == "cuda":
        _take_gpu(0, size)
    if len(START_CPUS) < size:
        log.warning("tensor parallel: %d ranks share %d core(s); each rank would need one of its own to keep up",
                    size, len(START_CPUS))
    shared_file = collectives.create_file(size) if collectives.available() and device == "cpu" else None
    workers = None
    try:
        store = dist.TCPStore("127.0.0.1", 0, world_size=size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        with _environment(OMP_PROC_BIND="false"):  # the workers pin themselves to their cores (_pin)
            shares = [core_share(rank, size) for rank in range(size)]  # a child's own view of its cores is rank 0's
            workers = mp.start_processes(_local_rank, args=(store.port, size, shares, follower_main, shared_file,
                                                            device),
                                         nprocs=size - 1, join=False, daemon=True, start_method="spawn")
        log.info("tensor parallel: %d ranks on this host, collectives through %s; workers are pids %s", size,
                 "shared memory" if shared_file else collective_backend(device), ", ".join(map(str, workers.pids())))
        _wait_for_workers(store, workers)
        dist.init_process_group(collective_backend(device), store=store, rank=0, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
    except BaseException:
        stop_workers(workers, grace_s=0)
        if shared_file is not None:
            shared_file.unlink(missing_ok=True)
        raise
    _pin(shares[0])
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), workers, shared_file


def _local_rank(index: int, port: int, size: int, shares: list[tuple[int, ...]], follower_main,
                shared_file: Path | None, device: str = "cpu") -> None:
    _pin(shares[index + 1])
    if device == "cuda":
        _take_gpu(index + 1, size)
    _die_with_parent()
    for signum in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole process group: rank 0 decides
        signal.signal(signum, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", port, world_size=size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(_started_key(index + 1), "1")
    dist.init_process_group(collective_backend(device), store=store, rank=index + 1, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    follower_main(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), shared_file)


@contextlib.contextmanager
def _environment(**values: str):
    """These environment variables for the processes started inside (spawn copies os.environ)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _wait_for_workers(store: dist.TCPStore, workers: mp.ProcessContext) -> None:
    """Until every worker has reached the store; a worker that dies first is reported at once, not after the
    rendezvous timeout."""
    keys = [_started_key(index + 1) for index in range(len(workers.processes))]
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        failed = any(process.exitcode is not None for process in workers.processes)
        if failed or time.monotonic() > deadline:
            message = f"tensor-parallel workers did not start: {rank_statuses(workers)}{worker_error(workers)}"
            stop_workers(workers, grace_s=0)
            raise TensorParallelError(message)
        time.sleep(0.05)


def _started_key(rank: int) -> str:
    return f"kvlm/started/{rank}"


def core_share(rank_on_host: int, ranks_on_host: int) -> tuple[int, ...]:
    """This rank's cores: an equal, separate share of the cores kvlm found at start (one each if too few)."""
    cpus = START_CPUS
    per_rank = max(1, len(cpus) // ranks_on_host)
    share = cpus[rank_on_host * per_rank : (rank_on_host + 1) * per_rank]
    return share or (cpus[rank_on_host % len(cpus)],)


def _pin(cores: tuple[int, ...]) -> None:
    """Run on these cores with one torch thread each. Without it, OpenMP's binding put every rank's main thread
    on the first core: two ranks shared one core and each waited for the other."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def _die_with_parent() -> None:
    """A worker whose parent dies is killed by the kernel, even if the parent had no time to stop it (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # elsewhere, the closed connection to rank 0 ends the worker


def loaded_barrier(control: dist.ProcessGroup) -> None:
    """Every rank has loaded its shard (gloo's monitored barrier names a rank that has not)."""
    dist.monitored_barrier(control, timeout=STARTUP_TIMEOUT)


def rank_statuses(workers: mp.ProcessContext | None) -> str:
    """What became of each local worker: 'rank 1 (pid 123) was killed by SIGKILL'."""
    if workers is None:
        return "see the other ranks' logs (launched by torchrun)"
    return "; ".join(f"rank {index + 1} (pid {process.pid}) {_fate(process.exitcode)}"
                     for index, process in enumerate(workers.processes))


def worker_error(workers: mp.ProcessContext | None) -> str:
    """'; rank 1 raised ValueError: ...' for a local worker that ended with an exception (empty otherwise)."""
    if workers is None:
        return ""
    try:
        workers.join(timeout=0)
    except mp.ProcessRaisedException as exc:
        last_line = str(exc).strip().splitlines()[-1]
        return f"; rank {exc.error_index + 1} raised {last_line}"
    except mp.ProcessExitedException:
        pass
    return ""


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
