"""kvlm's native library built for each -march the kernel tests run (tests/kernels/conftest.py's fixtures)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvlm.kernels.native import BuildError, NativeKernels, build, cpu_flags
from kvlm.startup import START_CPUS

# gcc -march values: this CPU's, AVX2 alone, plain x86-64 (no vector readers); where this CPU runs them (checked
# before loading, below), AVX-512 without VNNI, AVX-512 with VNNI (the products' vpdpbusd under AVX-512VL) and AVX2
# with AVX-VNNI (the same, VEX-encoded, with AVX2's 16 registers).
MARCHES = ["native", "x86-64-v3", "x86-64", "skylake-avx512", "cascadelake", "alderlake"]
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}  # the subsets gcc's skylake-avx512 emits
NEEDS = {"skylake-avx512": AVX512, "cascadelake": AVX512 | {"avx512_vnni"}, "alderlake": {"avx2", "avx_vnni"}}


def build_all() -> dict[str, Path | BuildError]:
    """Every -march's library (or why it could not be built), as many built at a time as there are cores: each
    build is one compiler process of about half a minute, and a clean clone builds all six."""
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
    missing = sorted(NEEDS.get(march, set()) - set(cpu_flags().split()))  # the kernel's own list of flags
    if missing:
        pytest.skip(f"this CPU cannot run -march={march} (no {', '.join(missing)})")  # before loading: it runs code
    return NativeKernels(library)
