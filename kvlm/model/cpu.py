"""What this CPU can do fast, detected at run time: the fast defaults are chosen from it, never assumed."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

# oneDNN's bfloat16 products and torch's weight-only int4/int8 kernels need these; without native bf16 dot
# products (avx512_bf16, AMX) they convert every value and lose to float32 (measured on AVX2: 2.5x slower).
AVX512_BASE = ("avx512_bw", "avx512_vl", "avx512_dq")
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuFeatures:
    name: str
    kernel_level: str            # torch's dispatch level: DEFAULT, AVX2, AVX512 (ATEN_CPU_CAPABILITY lowers it)
    flags: frozenset[str]

    @property
    def fast_bfloat16(self) -> bool:
        return (self.kernel_level.startswith("AVX512") and all(f in self.flags for f in AVX512_BASE)
                and any(f in self.flags for f in NATIVE_BF16))

    def describe(self) -> str:
        native = [f for f in NATIVE_BF16 if f in self.flags]
        return f"{self.name}, torch kernels {self.kernel_level}, bf16 instructions: {', '.join(native) or 'none'}"


@lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = frozenset(name for name, value in capabilities.items() if value is True)
    return CpuFeatures(str(capabilities.get("cpu_name", "unknown CPU")), torch.backends.cpu.get_cpu_capability(),
                       flags)


@lru_cache(maxsize=None)
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights of this dtype here (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT;
    ONEDNN_MAX_CPU_ISA may forbid them): tried once on a tiny matrix rather than inferred from flags."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(2, 2, dtype=dtype), 2)
    except RuntimeError:
        return False
    return True
