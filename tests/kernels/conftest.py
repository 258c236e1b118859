"""The kernels' shared fixture: `kernels`, kvlm's native library built for each -march (test_expert_kernel builds
its own)."""
from __future__ import annotations

import pytest

from kvlm.kernels.native import BuildError, NativeKernels, build, compiler, cpu_flags

# gcc -march values: this CPU's, AVX2 alone, plain x86-64 (no vector readers); AVX-512 without VNNI if this CPU can
# run it (checked by running the build, below).
MARCHES = ["native", "x86-64-v3", "x86-64", "skylake-avx512"]


@pytest.fixture(scope="module", params=MARCHES)
def kernels(request):
    if compiler() is None:
        pytest.skip("no C++ compiler here: the pure-torch path is tested instead")
    try:
        library = build(request.param)
    except BuildError as exc:
        pytest.skip(f"cannot build for -march={request.param}: {exc}")
    if request.param == "skylake-avx512" and not runs_avx512():
        pytest.skip("this CPU cannot run AVX-512")  # before loading: loading runs the library's code
    return NativeKernels(library)


def runs_avx512() -> bool:
    """Whether this CPU has the AVX-512 subsets gcc's skylake-avx512 emits (from the kernel's own list of flags)."""
    flags = set(cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags
