"""Saving one sequence's cells to bytes and loading them back, as llama.cpp's sequence state files do.

Layout: magic, format version, a JSON header (model identity, KV dtype, layer count, the memory's pools and
each one's cell count), the cells' positions (int64, pool after pool), each K/V storage part (every layer's rows
of those cells, pool after pool), then a CRC32 of everything before it. Everything is checked before the memory
is touched.
"""
from __future__ import annotations

import io
import json
import struct
import zlib

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvlm.core.errors import CacheError
from kvlm.core.family import ATTENTION
from kvlm.core.config import ModelConfig

if TYPE_CHECKING:
    from kvlm.memory.memory import KVMemory
    from kvlm.memory.recurrent import RecurrentMemory

MAGIC = b"KVLMSEQ\0"
VERSION = 2


class StateError(CacheError):
    """A saved sequence state cannot be loaded here."""


def model_identity(config: ModelConfig) -> str:
    full = "x".join(map(str, config.attention_geometry(ATTENTION)))  # full layers may have rows of their own size
    return (f"{config.architecture}/{config.name}/L{config.n_layer}/E{config.n_embd}/H{config.n_head}"
            f"/KV{config.n_head_kv}x{config.head_dim}/full{full}/shared{config.n_kv_shared}/V{config.vocab_size}"
            f"/rope{config.rope}")


def save_sequence(pools: tuple[KVMemory, ...], seq_id: int, recurrent: RecurrentMemory | None = None) -> bytes:
    """Every pool's cells of one sequence (their positions and K/V rows), and its recurrent state if any."""
    positions, parts, counts = [], [], []
    for pool in pools:
        cells = pool.cells.seq_cells(seq_id)
        rows = torch.from_numpy(cells)
        positions.append(pool.cells.pos[cells])
        parts += [part for plane in (pool.store.k, pool.store.v) for part in plane.gather(rows)]
        counts.append(len(cells))
    header = {**_layout(pools, recurrent), "pool_cells": counts}
    if recurrent is not None:
        header["recurrent_span"], recurrent_parts = recurrent.state_parts(seq_id)
        parts += recurrent_parts
    return encode_state(header, np.concatenate(positions) if positions else np.empty(0, np.int64), parts)


def load_sequence(pools: tuple[KVMemory, ...], data: bytes, dest_seq_id: int,
                  recurrent: RecurrentMemory | None = None) -> None:
    """Put a saved sequence into `dest_seq_id` of every pool (and the recurrent state); it must be empty and fit,
    else nothing changes."""
    header, positions, parts = decode_state(data, _layout(pools, recurrent))
    counts = header["pool_cells"]
    n_kv_parts = 2 * len(pools) * len(pools[0].store.k.gather(torch.zeros(0, dtype=torch.long))) if pools else 0
    kv_parts, recurrent_parts = parts[:n_kv_parts], parts[n_kv_parts:]
    if recurrent is not None:
        recurrent.check_parts(header["recurrent_span"], recurrent_parts, dest_seq_id)
    for pool in pools:
        if pool.cells.seq_pos_max(dest_seq_id) != -1:
            raise StateError(f"destination sequence {dest_seq_id} is not empty (positions "
                             f"{pool.cells.seq_pos_min(dest_seq_id)}..{pool.cells.seq_pos_max(dest_seq_id)})")
    per_pool = n_kv_parts // max(len(pools), 1)
    placements = []
    for index, (pool, n_cells) in enumerate(zip(pools, counts)):
        start = sum(counts[:index])
        pool_parts = kv_parts[index * per_pool : (index + 1) * per_pool]
        placements.append((pool, positions[start : start + n_cells], _checked_parts(pool, pool_parts, n_cells)))
    slots = [_free_cells_for(pool, len(pool_positions)) for pool, pool_positions, _ in placements]
    for (pool, pool_positions, (k_parts, v_parts)), slot in zip(placements, slots):
        if slot is None:
            continue
        rows = torch.from_numpy(slot)
        pool.store.k.scatter(rows, k_parts)
        pool.store.v.scatter(rows, v_parts)
        seq_mask = np.zeros((len(slot), pool.cells.n_seq_max), dtype=bool)
        seq_mask[:, dest_seq_id] = True
        pool.cells.apply(slot, pool_positions, seq_mask)
    if recurrent is not None:
        recurrent.load_parts(header["recurrent_span"], recurrent_parts, dest_seq_id)


def check_state(pools: tuple[KVMemory, ...], data: bytes) -> None:
    """Raise StateError unless `data` is a state these pools could load (format, checksum, shapes)."""
    decode_state(data, _layout(pools, None))


def _layout(pools: tuple[KVMemory, ...], recurrent: RecurrentMemory | None) -> dict:
    config = pools[0].config if pools else recurrent.config
    return {"model": model_identity(config), "kv_dtype": pools[0].kv_dtype if pools else None,
            "n_layer": config.n_layer, "pools": [[pool.name, pool.store.n_layer] for pool in pools],
            "recurrent_layers": recurrent.n_layer if recurrent is not None else 0}


def _free_cells_for(pool: KVMemory, n_cells: int) -> np.ndarray | None:
    if n_cells == 0:
        return None
    slot = pool.cells.find_slot(n_cells)
    if slot is None:
        raise CacheError(f"no room to load the state in the {pool.name!r} pool: it needs {n_cells} cells, "
                         f"{pool.n_cells - pool.n_used} are free")
    return slot


def _checked_parts(pool: KVMemory, parts: list[torch.Tensor], n_cells: int):
    """Split saved parts into K and V after checking they fit this pool's layout exactly."""
    store = pool.store
    expected = [p for plane in (store.k, store.v) for p in plane.gather(torch.zeros(n_cells, dtype=torch.long))]
    layout = lambda ps: [(p.dtype, tuple(p.shape)) for p in ps]  # noqa: E731
    if layout(parts) != layout(expected):
        raise StateError(f"state tensors {layout(parts)} do not fit this context's layout {layout(expected)}")
    return parts[: len(parts) // 2], parts[len(parts) // 2 :]


def encode_state(header: dict, positions: np.ndarray, parts: list[torch.Tensor]) -> bytes:
    out = io.BytesIO()
    header_bytes = json.dumps({**header, "parts": [[str(p.dtype), list(p.shape)] for p in parts]}).encode()
    out.write(MAGIC + struct.pack("<II", VERSION, len(header_bytes)) + header_bytes)
    out.write(positions.astype("<i8").tobytes())
    for part in parts:
        out.write(_tensor_bytes(part))
    body = out.getvalue()
    return body + struct.pack("<I", zlib.crc32(body))


def blob_head(header: dict, n_bytes: int) -> bytes:
    """What precedes a blob of `n_bytes` in a state of no cells and one uint8 part (as encode_state writes it);
    the blob and blob_checksum(head, blob) follow, so a large blob is written without being copied."""
    header_bytes = json.dumps({**header, "pool_cells": [], "parts": [["torch.uint8", [n_bytes]]]}).encode()
    return MAGIC + struct.pack("<II", VERSION, len(header_bytes)) + header_bytes


def blob_checksum(head: bytes, blob: bytes) -> bytes:
    return struct.pack("<I", zlib.crc32(blob, zlib.crc32(head)))


def decode_state(data: bytes, expected: dict) -> tuple[dict, np.ndarray, list[torch.Tensor]]:
    """Header, positions and storage parts of a state, after checking it belongs to `expected` (identity etc.)."""
    header, offset = _read_header(data)
    for key, value in expected.items():
        if header.get(key) != value:
            raise StateError(f"state was saved with {key}={header.get(key)!r}, this context has {value!r}")
    n_cells = sum(header["pool_cells"])
    positions = np.frombuffer(_take(data, offset, 8 * n_cells), dtype="<i8").astype(np.int64)
    offset += 8 * n_cells
    parts = []
    for dtype_name, shape in header["parts"]:
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        size = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        raw = bytearray(_take(data, offset, size))
        parts.append(torch.frombuffer(raw, dtype=dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype))
        offset += size
    if offset != len(data) - 4:
        raise StateError(f"state has {len(data) - 4 - offset} unexpected trailing bytes")
    return header, positions, parts


def _read_header(data: bytes) -> tuple[dict, int]:
    if len(data) < len(MAGIC) + 12 or not data.startswith(MAGIC):
        raise StateError("not a kvlm sequence state (bad magic or too short)")
    (crc,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != crc:
        raise StateError("sequence state is corrupt or truncated (checksum mismatch)")
    header_len = _header_length(data)
    start = len(MAGIC) + 8
    return json.loads(_take(data, start, header_len)), start + header_len


def peek_header(file) -> dict:
    """A state file's header, read from its start without its body: unchecked (decode_state checks everything)."""
    return json.loads(file.read(_header_length(file.read(len(MAGIC) + 8))))


def _header_length(head: bytes) -> int:
    """The JSON header's length, after checking the magic and the format version."""
    if len(head) < len(MAGIC) + 8 or not head.startswith(MAGIC):
        raise StateError("not a kvlm sequence state (bad magic or too short)")
    version, header_len = struct.unpack_from("<II", head, len(MAGIC))
    if version != VERSION:
        raise StateError(f"sequence state format version {version} is not supported (this kvlm reads {VERSION})")
    return header_len


def _take(data: bytes, offset: int, size: int) -> bytes:
    if offset + size > len(data) - 4:
        raise StateError(f"sequence state is truncated: needs {offset + size + 4} bytes, has {len(data)}")
    return data[offset : offset + size]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.cpu().contiguous().view(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
