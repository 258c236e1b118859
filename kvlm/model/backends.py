"""Which backend (kvlm.model.backend's table of hot ops) a decoder runs on.

On a GPU, the Triton kernels (torch's ops on the GPU in the reference mode). On the CPU, the native kernels where they
are built and the mode is not the reference one (which stays on torch's ops, as transformers computes), torch's ops
otherwise. KVLM_BACKEND names one outright: "cpu", "torch", or "triton"
(the GPU's Triton kernels, kvlm.model.triton_backend; on a machine without a GPU through Triton's interpreter, with
TRITON_INTERPRET=1 set before torch is imported).
"""
from __future__ import annotations

import os
from collections.abc import Callable

from kvlm.kernels import native_kernels
from kvlm.kernels.gpu import triton_available
from kvlm.model.backend import Backend, NativeCpuBackend, TorchBackend
from kvlm.model.settings import ComputeSettings

ENVIRONMENT = "KVLM_BACKEND"


def _torch(settings: ComputeSettings) -> Backend:
    return TorchBackend(settings.batch_invariant, settings.device)


def _cpu(settings: ComputeSettings) -> Backend:
    if settings.device != "cpu":
        raise ValueError(f"{ENVIRONMENT}=cpu runs on the CPU, not on device {settings.device!r}: use device 'cpu'")
    kernels = native_kernels()
    if kernels is None:
        raise ValueError(f"{ENVIRONMENT}=cpu needs kvlm's native kernels, which could not be built here (see the log)")
    return NativeCpuBackend(kernels, settings.batch_invariant)


def _triton(settings: ComputeSettings) -> Backend:
    if not triton_available():
        raise ValueError(f"{ENVIRONMENT}=triton needs Triton (it comes with CUDA builds of torch; pip install triton)")
    if settings.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{ENVIRONMENT}=triton on the CPU needs TRITON_INTERPRET=1, set before torch is imported, to "
                         "run its kernels through Triton's interpreter (on a GPU: device 'cuda')")
    from kvlm.model.triton_backend import TritonBackend  # (imports triton: only when asked for)

    return TritonBackend(settings.device)


# Every backend by name: a new device is one more entry.
BACKENDS: dict[str, Callable[[ComputeSettings], Backend]] = {"torch": _torch, "cpu": _cpu, "triton": _triton}


def backend_for(settings: ComputeSettings) -> Backend:
    """KVLM_BACKEND's backend where it names one; else on a GPU the Triton one (torch's for the reference mode); on
    the CPU the native one where its kernels are built and the mode is not the reference one, torch's otherwise."""
    name = os.environ.get(ENVIRONMENT, "")
    if name:
        if name not in BACKENDS:
            raise ValueError(f"{ENVIRONMENT}={name!r} is not a backend (backends: {', '.join(BACKENDS)})")
        return BACKENDS[name](settings)
    if settings.device != "cpu":
        return _torch(settings) if settings.reference else _triton(settings)
    if settings.reference or native_kernels() is None:
        return _torch(settings)
    return _cpu(settings)
