"""The K and V tensors of every layer, layer-major: [layer][cell][kv_head][head_dim]."""
from __future__ import annotations

import torch

from kvlm.core.errors import CacheError
from kvlm.core.family import ATTENTION
from kvlm.core.config import ModelConfig

DENSE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
Q8_BLOCK = 32
# q8_0 as in ggml: blocks of 32 int8 values sharing one float16 scale, 34 bytes per 32 values.
BYTES_PER_ELEMENT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": (Q8_BLOCK + 2) / Q8_BLOCK}
KV_DTYPES = tuple(BYTES_PER_ELEMENT)
AUTO = "auto"


def resolve_kv_dtype(kv_dtype: str, compute_dtype: torch.dtype, quantized: bool = False) -> str:
    """"auto": bf16 for a bfloat16 model (vLLM's default, the model's own dtype); for a float32 one, f32 in the
    reference mode (dense weights, as transformers) and f16 when its weights are quantized (the fast mode:
    llama.cpp's default, half the bytes decode attention reads and the cache holds)."""
    if kv_dtype != AUTO:
        return kv_dtype
    if compute_dtype == torch.bfloat16:
        return "bf16"
    return "f16" if quantized else "f32"


def kv_bytes_for(config: ModelConfig, n_cells: int, dtype: str, n_layer: int | None = None,
                 kind: str = ATTENTION) -> int:
    """2 x layers x cells x kv_heads x head_dim x bytes_per_element, without allocating anything: of a pool of
    `n_layer` layers of `kind` (their geometry, see ModelConfig.attention_geometry); by default of every layer
    that holds K/V, each with its kind's geometry (a layer reading another's K/V holds none)."""
    if n_layer is None:
        return sum(kv_bytes_for(config, n_cells, dtype, 1, config.layer_kinds[i]) for i in config.kv_layers)
    n_kv, head_dim = config.attention_geometry(kind)
    return int(2 * n_layer * n_cells * n_kv * head_dim * BYTES_PER_ELEMENT[dtype])


class DensePlane:
    """One of K or V stored as a float tensor."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.data = torch.zeros(shape, dtype=DENSE_DTYPES[dtype])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.data[layer].index_copy_(0, on(rows, self.data), values.to(self.data.dtype))

    def read(self, layer: int, n_rows: int) -> torch.Tensor:
        return self.data[layer, :n_rows]

    def native(self, layer: int) -> tuple[torch.Tensor, None]:
        """One layer's rows as stored, for kernels that read them in place: (data [cells, kv_head, head_dim], None)."""
        return self.data[layer], None

    def stored(self) -> tuple[torch.Tensor, None]:
        """Every layer's rows as stored, for kernels that write them in place: (data [layer, cells, ...], None)."""
        return self.data, None

    def write_layers(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """values [n_layer, n_rows, kv_head, head_dim]: the rows of every layer in one copy."""
        self.data.index_copy_(1, on(rows, self.data), values.to(self.data.dtype))

    def gather(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The stored form of some rows, every layer: what a saved state holds."""
        return [self.data[:, on(rows, self.data)].clone()]

    def scatter(self, rows: torch.Tensor, parts: list[torch.Tensor]) -> None:
        self.data[:, on(rows, self.data)] = on(parts[0], self.data)


class Q8Plane:
    """One of K or V as int8 blocks of 32 along head_dim with a float16 scale; dequantized to read."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        if shape[-1] % Q8_BLOCK:
            raise CacheError(f"q8_0 needs head_dim divisible by {Q8_BLOCK}, got {shape[-1]}")
        self.quants = torch.zeros(shape, dtype=torch.int8)
        self.scales = torch.zeros(*shape[:-1], shape[-1] // Q8_BLOCK, dtype=torch.float16)

    @property
    def nbytes(self) -> int:
        return self.quants.numel() + self.scales.numel() * 2

    def write(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        blocks = values.float().unflatten(-1, (-1, Q8_BLOCK))
        scale = blocks.abs().amax(-1) / 127
        quants = torch.round(blocks / scale.clamp_min(1e-30)[..., None]).clamp_(-127, 127)
        rows = on(rows, self.quants)
        self.quants[layer].index_copy_(0, rows, quants.flatten(-2).to(torch.int8))
        self.scales[layer].index_copy_(0, rows, scale.to(torch.float16))

    def read(self, layer: int, n_rows: int) -> torch.Tensor:
        blocks = self.quants[layer, :n_rows].unflatten(-1, (-1, Q8_BLOCK)).float()
        return (blocks * self.scales[layer, :n_rows, ..., None].float()).flatten(-2)

    def native(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's rows as stored: (int8 quants [cells, kv_head, head_dim], float16 scales [..., head_dim / 32])."""
        return self.quants[layer], self.scales[layer]

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's rows as stored: (int8 quants [layer, cells, ...], float16 scales [layer, cells, ...])."""
        return self.quants, self.scales

    def gather(self, rows: torch.Tensor) -> list[torch.Tensor]:
        rows = on(rows, self.quants)
        return [self.quants[:, rows].clone(), self.scales[:, rows].clone()]

    def scatter(self, rows: torch.Tensor, parts: list[torch.Tensor]) -> None:
        rows = on(rows, self.quants)
        self.quants[:, rows] = on(parts[0], self.quants)
        self.scales[:, rows] = on(parts[1], self.quants)


def on(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` on `like`'s device: cell indices and saved rows come from the host, the planes may be on a GPU."""
    return tensor if tensor.device == like.device else tensor.to(like.device)


def _plane(shape: tuple[int, ...], dtype: str) -> DensePlane | Q8Plane:
    return Q8Plane(shape) if dtype == "q8_0" else DensePlane(shape, dtype)


class KVStore:
    """K and V kept apart, one row per cell; a row is written before anything may read it."""

    def __init__(self, config: ModelConfig, n_cells: int, dtype: str = "f32", n_layer: int | None = None,
                 kind: str = ATTENTION, spare_cell: bool = False) -> None:
        """`n_layer`: how many layers this store holds, when not all of the model's (one pool of several); `kind`:
        theirs, whose KV heads and head size the rows have (see ModelConfig.attention_geometry); `spare_cell`: one
        more row past the cells, never lent to a sequence, that the padded lanes of a CUDA graph's step write to
        (kvlm.model.cuda_graphs)."""
        if dtype not in BYTES_PER_ELEMENT:
            raise CacheError(f"KV dtype {dtype!r} is not supported (supported: {', '.join(KV_DTYPES)})")
        if n_cells <= 0:
            raise CacheError(f"KV cache size must be positive, got {n_cells} cells")
        self.spare_cell = n_cells if spare_cell else None
        self.shape = (config.n_layer if n_layer is None else n_layer, n_cells + spare_cell,
                      *config.attention_geometry(kind))
        self.k = _plane(self.shape, dtype)
        self.v = _plane(self.shape, dtype)

    @property
    def n_layer(self) -> int:
        return self.shape[0]

    @property
    def device(self) -> torch.device:
        """Where its rows are (a GPU's memory when the memory was made under torch.device("cuda"))."""
        return self.k.stored()[0].device

    @property
    def n_cells(self) -> int:
        """The cells sequences may hold (the spare cell excluded)."""
        return self.shape[1] if self.spare_cell is None else self.spare_cell

    @property
    def kv_bytes(self) -> int:
        """2 x layers x cells x kv_heads x head_dim x bytes_per_element."""
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.write(layer, rows, k)
        self.v.write(layer, rows, v)

    @property
    def dense(self) -> bool:
        """Whether K and V are plain float tensors (`k.data`, `v.data`), as compiled graphs read them."""
        return isinstance(self.k, DensePlane)

    def write_layers(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows of every layer at once, k and v [n_layer, n_rows, kv_head, head_dim]; dense stores only."""
        self.k.write_layers(rows, k)
        self.v.write_layers(rows, v)

    def read(self, layer: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows 0 .. n_rows-1 of one layer, [n_rows, kv_head, head_dim] (a view for float dtypes)."""
        return self.k.read(layer, n_rows), self.v.read(layer, n_rows)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows of every layer, K and V, from cells src to cells dst."""
        for plane in (self.k, self.v):
            plane.scatter(dst, plane.gather(src))
