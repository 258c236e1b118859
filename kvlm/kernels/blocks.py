"""A matrix as a GGUF file stores it: each row a run of quantized blocks, kept as raw bytes.

Rows are independent (a block never spans two rows), so selecting rows is selecting byte rows; columns can be cut
only at block boundaries. A matrix `interleaved` by the native kernels (kvlm/kernels/csrc/tiles.h) holds the same
bytes rearranged within tiles of 8 rows: it can only be cut between tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# The block formats the native products and kvlm's own dequantization read (formats.h, low_bit_formats.h,
# reference.py): every block format the `gguf` package dequantizes.
NATIVE_TYPES = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ2_XS,
    GGMLQuantizationType.IQ2_S, GGMLQuantizationType.IQ3_XXS, GGMLQuantizationType.IQ3_S, GGMLQuantizationType.IQ1_S,
    GGMLQuantizationType.IQ1_M, GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS, GGMLQuantizationType.TQ1_0,
    GGMLQuantizationType.TQ2_0, GGMLQuantizationType.MXFP4, GGMLQuantizationType.NVFP4,
})

# The formats the native products also read in interleaved tiles of 8 rows (tiles.h); the others in the file's layout.
TILED_TYPES = frozenset({
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.MXFP4, GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.IQ4_XS,
    GGMLQuantizationType.IQ3_S,
})


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    return n_cols // block_weights * block_bytes


TILE_ROWS = 8  # rows per interleaved tile


@dataclass(frozen=True)
class BlockMatrix:
    blocks: torch.Tensor  # uint8 [rows, row_bytes]
    qtype: GGMLQuantizationType
    n_cols: int
    interleaved: bool = False  # rows rearranged in tiles of 8 for the native products (same bytes, same shape)

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
        """Some rows; of an interleaved matrix only a slice between tiles (its start and stop multiples of 8)."""
        if self.interleaved:
            whole = isinstance(index, slice) and index.step in (None, 1)
            start, stop, _ = index.indices(self.shape[0]) if whole else (1, 1, 1)
            if not whole or start % TILE_ROWS or (stop % TILE_ROWS and stop != self.shape[0]):
                raise ValueError(f"an interleaved matrix is cut only between tiles of {TILE_ROWS} rows, not at {index}")
            return BlockMatrix(self.blocks[index], self.qtype, self.n_cols, interleaved=True)
        return BlockMatrix(self.blocks[index].contiguous(), self.qtype, self.n_cols)

    def columns(self, start: int, stop: int) -> BlockMatrix:
        """Columns start..stop, which must fall on block boundaries."""
        if self.interleaved:
            raise ValueError("an interleaved matrix cannot be cut by columns (its tiles mix the rows' blocks)")
        if start % self.block_weights or stop % self.block_weights:
            raise ValueError(f"{self.qtype.name} columns can be cut only at multiples of {self.block_weights}; "
                             f"asked for {start}..{stop}")
        block_weights, block_bytes = GGML_QUANT_SIZES[self.qtype]
        first, last = start // block_weights * block_bytes, stop // block_weights * block_bytes
        return BlockMatrix(self.blocks[:, first:last].contiguous(), self.qtype, stop - start)
