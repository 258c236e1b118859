"""The K and V tensors of every layer, layer-major: [layer][cell][kv_head][head_dim]."""
from __future__ import annotations

import torch

from kvlm.errors import CacheError
from kvlm.loader.config import ModelConfig

KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def kv_bytes_for(config: ModelConfig, n_cells: int, dtype: str) -> int:
    """2 x layers x cells x kv_heads x head_dim x bytes_per_element, without allocating anything."""
    element = torch.tensor([], dtype=KV_DTYPES[dtype]).element_size()
    return 2 * config.n_layer * n_cells * config.n_head_kv * config.head_dim * element


class KVStore:
    """K and V kept apart, one row per cell; a row is written before anything may read it."""

    def __init__(self, config: ModelConfig, n_cells: int, dtype: str = "f32") -> None:
        if dtype not in KV_DTYPES:
            raise CacheError(f"KV dtype {dtype!r} is not supported (supported: {', '.join(KV_DTYPES)})")
        if n_cells <= 0:
            raise CacheError(f"KV cache size must be positive, got {n_cells} cells")
        shape = (config.n_layer, n_cells, config.n_head_kv, config.head_dim)
        self.dtype_name = dtype
        self.k = torch.zeros(shape, dtype=KV_DTYPES[dtype])
        self.v = torch.zeros(shape, dtype=KV_DTYPES[dtype])

    @property
    def n_layer(self) -> int:
        return self.k.shape[0]

    @property
    def n_cells(self) -> int:
        return self.k.shape[1]

    @property
    def bytes_per_element(self) -> int:
        return self.k.element_size()

    @property
    def kv_bytes(self) -> int:
        """2 x layers x cells x kv_heads x head_dim x bytes_per_element."""
        return 2 * self.k.numel() * self.bytes_per_element

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, rows, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, rows, v.to(self.v.dtype))

    def read(self, layer: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0 .. n_rows-1 of one layer, [n_rows, kv_head, head_dim], without copying."""
        return self.k[layer, :n_rows], self.v[layer, :n_rows]
