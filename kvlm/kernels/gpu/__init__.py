"""Triton kernels for GPUs, each beside the pure-torch reference its tests hold it to (kvlm.kernels.gpu.reference).

- `attention`: queries over the cells each token reads (kvlm.memory.view.TokenCells), prompts and decode tokens
  alike, split over long runs and reduced; GQA groups together; sinks, a logit softcap; every KV dtype kvlm has.
- `kv_write`: this step's K/V rows into their cells (q8_0 quantized as the CPU store does).
- `layer_ops`: RMSNorm (with the residual add), RoPE.

Triton is optional (`triton_available()`): it comes with a CUDA build of torch, and with the test extras on a CPU,
where `TRITON_INTERPRET=1` (set before these modules are imported) runs the same kernels through Triton's
interpreter. The interpreter gets bfloat16 arithmetic wrong, so every kernel turns what it loads into float32 first.
"""
from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether Triton can be imported here."""
    return importlib.util.find_spec("triton") is not None
