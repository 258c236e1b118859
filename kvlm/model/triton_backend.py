"""The GPU backend: kvlm.kernels.gpu's Triton kernels for attention over cells, RMSNorm (with the residual add) and
RoPE; torch's ops for the rest (dense products, a GGUF's blocks dequantized at load; the recurrent layers' scans).

Chosen on a GPU (settings.device "cuda"), and with KVLM_BACKEND=triton. On a machine without a GPU, TRITON_INTERPRET=1 (set before torch is imported) runs
the same kernels through Triton's interpreter on CPU tensors: slow, but every kernel and the whole engine can be
checked there. Not batch-invariant: a long run's split count and a prompt tile's first cell follow the batch, and
with them the order of a softmax's sums.
"""
from __future__ import annotations

import torch

from kvlm.kernels.gpu import attention, kv_write, layer_ops
from kvlm.memory.kv_store import on
from kvlm.model.backend import TorchBackend


class TritonAttention:
    """Attention over cells as kvlm.model.attention calls the backend's kernel, and the step's K/V rows written into
    their cells first (one launch per plane, a q8_0 plane quantized in it)."""

    writes_kv = True

    @staticmethod
    def takes_head_dim(head_dim: int) -> bool:
        return True

    @staticmethod
    def attention(q: torch.Tensor, k_plane: tuple, v_plane: tuple, cells, scale: float,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        return attention.attention(q.contiguous(), k_plane, v_plane, cells, scale, sinks)

    @staticmethod
    def write_kv(view, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n_tokens, n_kv, d] into the cells `view.rows` of layer `layer` of the view's store."""
        rows = on(view.rows, k).long()
        kv_write.kv_write(view.store.k.native(layer), rows, k)
        kv_write.kv_write(view.store.v.native(layer), rows, v)


class TritonBackend(TorchBackend):
    """Triton's kernels where their inputs fit (2-D contiguous rows, heads whose last two dimensions are dense),
    TorchBackend's ops otherwise."""

    name = "triton"

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(batch_invariant=False, device=device)  # (see the module: not batch-invariant)
        self._attention = TritonAttention()

    def attention_kernel(self) -> object | None:
        return self._attention

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():
            return layer_ops.rms_norm(x, weight, eps)[0]
        return super().norm(x, weight, eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and x.is_contiguous() and h.is_contiguous():
            return layer_ops.rms_norm(x, weight, eps, residual=h)
        return super().add_norm(x, h, weight, eps)

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place."""
        if qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]:
            return layer_ops.rope_(qk, cos.float(), sin.float())
        return super().rope(qk, cos, sin)
