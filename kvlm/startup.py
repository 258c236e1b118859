"""What must happen before torch starts its OpenMP threads: imported first by `import kvlm`; and the threads kvlm
starts beside its compute (a load's, a background writer's)."""
import os
import threading

# Pin OpenMP threads to cores before torch starts them. Unpinned, on small VMs, every parallel op of a
# batched decode paid for threads migrating between cores: 2-4x slower at 32-64 sequences
# (bench/multi_sequence). A value the user set wins.
os.environ.setdefault("OMP_PROC_BIND", "true")
# NumPy's OpenBLAS keeps threads of its own, which spin after each call: after one product big enough to use them
# (the cells' visibility at 32 sequences), they took a core from torch's OpenMP workers and every later step ran
# 2-3x slower. kvlm's NumPy products are small bookkeeping; one thread does them.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The cores this process may use, read before OpenMP pins the main thread to one of them: tensor parallelism
# shares them out between its ranks on this host.
START_CPUS = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(
    range(os.cpu_count() or 1))


def in_passing_thread(work):
    """work() on a thread that ends when it returns, and its result.

    libgomp keeps a pool of worker threads for every thread that ran a parallel region, and once there are more of
    them than cores it spins only ~100 times before sleeping at each barrier: every parallel region of the thread
    that computes then wakes sleeping workers through the kernel. A server that loads its model on the main thread
    and steps its engine on another decoded 40% slower for that (SmolLM2: 60 vs 105 tokens/s). Work done here leaves
    no pool behind: it goes with the thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="kvlm-load") as pool:
        return pool.submit(work).result()


def _yield_to_compute() -> None:
    """Run niced: while a writer thread checksums and copies, the compute threads keep their cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # (not on Linux: the thread runs as it is)
        pass


def niced_writer(name: str):
    """One niced thread that does file work handed to it in order, off the compute's threads; what it was given is
    finished before the process exits (concurrent.futures waits for its queue)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_yield_to_compute)
