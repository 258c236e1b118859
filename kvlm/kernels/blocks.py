"""A matrix as a GGUF file stores it: each row a run of quantized blocks, kept as raw bytes.

Rows are independent (a block never spans two rows), so selecting rows is selecting byte rows; columns can be cut
only at block boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# The block formats the native products and kvlm's own dequantization read (formats.h, reference.py).
NATIVE_TYPES = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    return n_cols // block_weights * block_bytes


@dataclass(frozen=True)
class BlockMatrix:
    blocks: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: GGMLQuantizationType
    n_cols: int

    def __post_init__(self) -> None:
        block_weights = GGML_QUANT_SIZES[self.qtype][0]
        if self.n_cols % block_weights:
            raise ValueError(f"a {self.qtype.name} row holds whole blocks of {block_weights}; got {self.n_cols} columns")
        expected = row_bytes(self.qtype, self.n_cols)
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != expected:
            raise ValueError(f"{self.qtype.name} blocks of {self.n_cols} columns need uint8 [rows, {expected}], got "
                             f"{self.blocks.dtype} {list(self.blocks.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.n_cols

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def block_weights(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    def rows(self, index: torch.Tensor | slice) -> BlockMatrix:
        return BlockMatrix(self.blocks[index].contiguous(), self.qtype, self.n_cols)

    def columns(self, start: int, stop: int) -> BlockMatrix:
        """Columns start..stop, which must fall on block boundaries."""
        if start % self.block_weights or stop % self.block_weights:
            raise ValueError(f"{self.qtype.name} columns can be cut only at multiples of {self.block_weights}; "
                             f"asked for {start}..{stop}")
        block_weights, block_bytes = GGML_QUANT_SIZES[self.qtype]
        first, last = start // block_weights * block_bytes, stop // block_weights * block_bytes
        return BlockMatrix(self.blocks[:, first:last].contiguous(), self.qtype, stop - start)
