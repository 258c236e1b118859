"""kvlm's native library built for each -march the kernel tests run (tests/kernels/conftest.py's fixtures)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvlm.kernels.native import BuildError, NativeKernels, build, cpu_flags
from kvlm.startup import START_CPUS

# gcc -march values: this CPU's, AVX2 alone, plain x86-64 (no vector readers); AVX-512 without VNNI if this CPU can
# run it (checked before loading, below).
MARCHES = ["native", "x86-64-v3", "x86-64", "skylake-avx512"]


def build_all() -> dict[str, Path | BuildError]:
    """Every -march's library (or why it could not be built), as many built at a time as there are cores: each
    build is one compiler process of about half a minute, and a clean clone builds all four."""
    def attempt(march: str) -> Path | BuildError:
        # torch's OpenMP has pinned the main thread, and so this one, to one core; the compiler it starts inherits
        # the mask, so give this thread back the cores the process started with, or the builds queue on one.
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, START_CPUS)
        try:
            return build(march)
        except BuildError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(MARCHES, pool.map(attempt, MARCHES)))


def kernels_for(march: str, libraries: dict[str, Path | BuildError]) -> NativeKernels:
    """The kernels built for `march`, or the test skipped saying why there are none."""
    library = libraries[march]
    if isinstance(library, BuildError):
        pytest.skip(f"cannot build for -march={march}: {library}")
    if march == "skylake-avx512" and not runs_avx512():
        pytest.skip("this CPU cannot run AVX-512")  # before loading: loading runs the library's code
    return NativeKernels(library)


def runs_avx512() -> bool:
    """Whether this CPU has the AVX-512 subsets gcc's skylake-avx512 emits (from the kernel's own list of flags)."""
    flags = set(cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags
