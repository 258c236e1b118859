"""What must happen before torch starts its OpenMP threads: imported first by `import kvlm`."""
import os

# Pin OpenMP threads to cores before torch starts them. Unpinned, on small VMs, every parallel op of a
# batched decode paid for threads migrating between cores: 2-4x slower at 32-64 sequences
# (bench/multi_sequence). A value the user set wins.
os.environ.setdefault("OMP_PROC_BIND", "true")
# The cores this process may use, read before OpenMP pins the main thread to one of them: tensor parallelism
# shares them out between its ranks on this host.
START_CPUS = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(
    range(os.cpu_count() or 1))
