"""Token embeddings: rows of the file's quantized table, dequantized per token, or of a dense one."""
from __future__ import annotations

import weakref

import torch

from kvlm.kernels import BlockMatrix, dequantize


class Embedding:
    """`table`: the file's blocks (kept as they are: a tied LM head multiplies by the same blocks) or floats."""

    def __init__(self, table: BlockMatrix | torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.blocks = table if isinstance(table, BlockMatrix) else None
        self.dense = None if self.blocks is not None else table.to(dtype).contiguous()
        self.dim = table.shape[1]
        _TABLES[id(self)] = self

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None and torch.compiler.is_compiling():
            return _rows(tokens, id(self))
        return self.rows(tokens)

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return self.dense[tokens]
        return dequantize(self.blocks, self.dtype, tokens.reshape(-1)).reshape(*tokens.shape, self.dim)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes if self.blocks is not None else self.dense.numel() * self.dense.element_size()


# Tables by handle, for graphs: the native lookup is one opaque op to inductor.
_TABLES: weakref.WeakValueDictionary[int, Embedding] = weakref.WeakValueDictionary()


@torch.library.custom_op("kvlm::embedding_rows", mutates_args=())
def _rows(tokens: torch.Tensor, handle: int) -> torch.Tensor:
    return _TABLES[handle].rows(tokens)


@_rows.register_fake
def _(tokens: torch.Tensor, handle: int) -> torch.Tensor:
    table = _TABLES[handle]
    return torch.empty(*tokens.shape, table.dim, dtype=table.dtype)
