"""The compute settings of a decoder: activation dtype and weight storage, chosen for this CPU unless given.

The defaults ("auto") are the fast, faithful setting: bfloat16 activations where the CPU has native bf16 dot
products (float32 elsewhere), and every matrix kept as its file stores it, in its quantized blocks, multiplied by
kvlm's native kernels straight from them. They are batch-invariant: a token's logits do not depend on what else
its batch holds nor on how its prompt reached the cache. `dtype="float32"` is the reference mode: dense float32
everywhere (gguf's dequantized values, with transformers' own products, whose logits it then matches); it is
batch-invariant only when asked (`batch_invariant=True`). Where the native kernels cannot be built (no compiler),
matrices are dense in the activation dtype.

`device`: "cpu", or "cuda" (an NVIDIA GPU through the Triton backend: weights dense in bfloat16, a GGUF's blocks
dequantized at load, the K/V cells and recurrent states in GPU memory); "auto" picks CUDA where torch sees a GPU.
"""
from __future__ import annotations

from collections.abc import Iterable

from dataclasses import dataclass

import torch

from kvlm.kernels import NATIVE_TYPES, native_kernels
from kvlm.model.cpu import CpuFeatures, detect

AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")
QUANTS = ("int8", "int4")  # every layer matrix requantized to Q8_0 or Q4_0 blocks
FROM_FILE = "file"  # each matrix in the blocks its file stores it in, where the kernels read them
NATIVE_TYPE_NAMES = frozenset(t.name for t in NATIVE_TYPES)


@dataclass(frozen=True)
class ComputeSettings:
    dtype: str                  # "float32" or "bfloat16": activations, norms, attention
    quant: str | None = None    # None: dense; "file": as stored; "int8"/"int4": every layer matrix requantized
    batch_invariant: bool = True  # a token's logits independent of its batch (see resolve_settings)
    reason: str = ""            # why these were chosen, for `kvlm inspect` and the server's log
    reference: bool = False     # the float32 reference mode: torch's ops throughout, as transformers computes
    device: str = "cpu"         # where weights, K/V cells and recurrent states live: "cpu" or "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def matrix_storage(self, stored_as: list[str]) -> str | None:
        """How a matrix stacked from parts stored as `stored_as` (GGUF type names, or torch dtype names for a
        Hugging Face folder) is held: "file" (its blocks), "int8"/"int4" (requantized), None (dense)."""
        if self.quant == FROM_FILE:
            return FROM_FILE if all(t in NATIVE_TYPE_NAMES for t in stored_as) else None
        return self.quant

    def describe(self, stored_as: Iterable[str] = ()) -> str:
        """The settings in words; `stored_as`: the file's tensor types, to name the block types held as stored."""
        weights = {None: "dense", FROM_FILE: "as the file stores them (its quantized blocks, read by native kernels)"}
        held = weights.get(self.quant, f"requantized {self.quant}")
        blocks = sorted(set(stored_as) & NATIVE_TYPE_NAMES)
        if self.quant == FROM_FILE and blocks:
            held = f"as the file stores them ({', '.join(blocks)} blocks, read by native kernels)"
        invariant = "batch-invariant" if self.batch_invariant else "not batch-invariant"
        where = "" if self.device == "cpu" else f"on {self.device}, "
        return f"{where}{self.dtype} activations, weights {held}, {invariant}: {self.reason}"


def resolve_settings(dtype: str = AUTO, quant: str | None = AUTO, batch_invariant: bool = False,
                     cpu: CpuFeatures | None = None, kernels: bool | None = None,
                     compile: bool = False, device: str = "cpu") -> ComputeSettings:
    """Checks the requested settings (before any weight is read) and fills in "auto" for this CPU.

    Every mode but the reference one is batch-invariant, whatever `batch_invariant` says; the reference mode is when
    asked. `compile` (graphs compiled by torch.compile, which sum as their shapes suit) gives that up.
    `kernels`: whether the native kernels are there (None: find out, building them if need be).
    """
    _check(dtype, quant)
    if device == AUTO and (quant in QUANTS or compile or batch_invariant):
        device = "cpu"  # what only the CPU does was asked for: "auto" does not pick a GPU that would refuse it
    device = resolve_device(device)
    if device != "cpu":
        return _gpu_settings(dtype, quant, device, compile, batch_invariant)
    cpu = cpu or detect()
    kernels = native_kernels() is not None if kernels is None else kernels
    if quant in QUANTS and not kernels:
        raise ValueError(f"quant {quant!r} needs kvlm's native kernels, which could not be built here (see the log); "
                         "use quant 'auto' or None")
    reference = dtype == "float32" and quant in (AUTO, None)  # dense float32, as transformers reads the file
    if dtype == AUTO and cpu.fast_bfloat16:
        dtype, why = "bfloat16", f"auto: native bf16 at AVX-512 on this CPU ({cpu.describe()})"
    elif dtype == AUTO:
        dtype, why = "float32", f"auto: this CPU has no native bf16 at AVX-512 ({cpu.describe()})"
    else:
        why = "as requested"
    if quant == AUTO:
        quant = FROM_FILE if kernels and not reference else None
        if not kernels and not reference:
            why += "; the native kernels are unavailable, so weights are dense"
    return ComputeSettings(dtype, quant, not compile and (batch_invariant or not reference), why, reference)


def resolve_device(device: str) -> str:
    """"auto": CUDA where torch sees a GPU, else the CPU; "cuda" where torch sees none is an error."""
    if device not in (AUTO, *DEVICES):
        raise ValueError(f"device must be one of {AUTO}, {', '.join(DEVICES)}, got {device!r}")
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device 'cuda': torch {torch.__version__} sees no CUDA GPU here (built for CUDA "
                         f"{torch.version.cuda or 'none'}); use device 'cpu' or 'auto'")
    return device


def _gpu_settings(dtype: str, quant: str | None, device: str, compile: bool, batch_invariant: bool) -> ComputeSettings:
    """On a GPU: dense weights (bfloat16 unless float32 is asked for, the reference mode), no requantization, and
    not batch-invariant (the Triton attention's split counts and tiles follow the batch)."""
    if quant in QUANTS:
        raise ValueError(f"quant {quant!r} is the CPU's native kernels' (requantized blocks); on {device} weights "
                         "are dense: use quant 'auto' or None")
    if compile or batch_invariant:
        raise ValueError(f"{'compile' if compile else 'batch_invariant'} is not available on {device} yet")
    dtype = "bfloat16" if dtype == AUTO else dtype
    why = f"{device}: dense weights (a GGUF's blocks dequantized at load)"
    return ComputeSettings(dtype, None, False, why, reference=dtype == "float32", device=device)


def _check(dtype: str, quant: str | None) -> None:
    if dtype not in (AUTO, *DTYPES):
        raise ValueError(f"dtype must be one of {AUTO}, {', '.join(DTYPES)}, got {dtype!r}")
    if quant not in (AUTO, None, *QUANTS):
        raise ValueError(f"quant must be one of {AUTO}, None, {', '.join(QUANTS)}, got {quant!r}")
