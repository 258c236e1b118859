"""The compute settings of a decoder: activation dtype and weight format, chosen for this CPU unless given.

The defaults ("auto") are the fast, faithful setting: bfloat16 activations where the CPU has native bf16 dot
products, and each matrix kept in the precision its file stores it in (a Q4 tensor as int4, a Q5/Q6/Q8
tensor as int8, a float tensor dense). `dtype="float32"` is the reference mode: dense float32 everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.model.cpu import CpuFeatures, detect

AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTS = ("int8", "int4")
FROM_FILE = "file"  # each matrix quantized as its file stores it

# GGUF tensor types by the weight-only kernel that keeps their precision: 4-bit blocks (and coarser) as
# int4 in groups of 32 (Q4_1 exactly, Q4_0 and Q4_K within half their step); 5- to 8-bit blocks as int8 per row.
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS",
                        "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"})
INT8_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})


@dataclass(frozen=True)
class ComputeSettings:
    dtype: str                  # "float32" or "bfloat16": activations, norms, attention
    quant: str | None = None    # None: dense; "int8"/"int4": every layer matrix; "file": as each is stored
    batch_invariant: bool = False
    reason: str = ""            # why these were chosen, for `kvlm inspect` and the server's log

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def matrix_quant(self, file_types: list[str]) -> str | None:
        """The weight-only kernel for a matrix stacked from tensors of these file types (None: dense)."""
        if self.quant != FROM_FILE:
            return self.quant
        if all(t in INT4_TYPES for t in file_types):
            return "int4"
        if all(t in INT4_TYPES | INT8_TYPES for t in file_types):
            return "int8"
        return None

    def describe(self) -> str:
        weights = {None: "dense", FROM_FILE: "as stored in the file (Q4 -> int4, Q5-Q8 -> int8, float -> dense)"}
        return f"{self.dtype} activations, weights {weights.get(self.quant, self.quant)}: {self.reason}"


def resolve_settings(dtype: str = AUTO, quant: str | None = AUTO, batch_invariant: bool = False,
                     cpu: CpuFeatures | None = None) -> ComputeSettings:
    """Checks the requested settings (before any weight is read) and fills in "auto" for this CPU."""
    _check(dtype, quant, batch_invariant)
    cpu = cpu or detect()
    if dtype == AUTO and quant in QUANTS:
        dtype, why = "bfloat16", f"the {quant} kernels take bfloat16 activations"
    elif dtype == AUTO and batch_invariant:
        dtype, why = "float32", "batch_invariant needs float32"
    elif dtype == AUTO and cpu.fast_bfloat16:
        dtype, why = "bfloat16", f"auto: native bf16 at AVX-512 on this CPU ({cpu.describe()})"
    elif dtype == AUTO:
        dtype, why = "float32", (f"auto: this CPU has no native bf16 at AVX-512 ({cpu.describe()}), where the "
                                 "bf16 and weight-only int kernels are slower than float32")
    else:
        why = "as requested"
    if quant == AUTO:
        quant = FROM_FILE if dtype == "bfloat16" else None
    return ComputeSettings(dtype, quant, batch_invariant, why)


def _check(dtype: str, quant: str | None, batch_invariant: bool) -> None:
    if dtype not in (AUTO, *DTYPES):
        raise ValueError(f"dtype must be one of {AUTO}, {', '.join(DTYPES)}, got {dtype!r}")
    if quant not in (AUTO, None, *QUANTS):
        raise ValueError(f"quant must be one of {AUTO}, None, {', '.join(QUANTS)}, got {quant!r}")
    if quant in QUANTS and dtype == "float32":
        raise ValueError(f"quant {quant!r} needs dtype bfloat16 (or auto), got dtype float32")
    if batch_invariant and (dtype == "bfloat16" or quant in QUANTS):
        raise ValueError(f"batch_invariant needs dense float32 weights, got dtype {dtype} and quant {quant!r}")
