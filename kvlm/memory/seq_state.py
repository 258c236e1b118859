"""Saving one sequence's cells to bytes and loading them back, as llama.cpp's sequence state files do.

Layout: magic, format version, a JSON header (model identity, KV dtype, layer count, cell count), the
cells' positions (int64), each K/V storage part (every layer's rows of those cells), then a CRC32 of
everything before it. Everything is checked before the memory is touched.
"""
from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import torch

from kvlm.errors import CacheError
from kvlm.loader.config import ModelConfig

MAGIC = b"KVLMSEQ\0"
VERSION = 1


class StateError(CacheError):
    """A saved sequence state cannot be loaded here."""


def model_identity(config: ModelConfig) -> str:
    return (f"{config.architecture}/{config.name}/L{config.n_layer}/E{config.n_embd}/H{config.n_head}"
            f"/KV{config.n_head_kv}x{config.head_dim}/V{config.vocab_size}/rope{config.rope}")


def encode_state(header: dict, positions: np.ndarray, parts: list[torch.Tensor]) -> bytes:
    out = io.BytesIO()
    header_bytes = json.dumps({**header, "parts": [[str(p.dtype), list(p.shape)] for p in parts]}).encode()
    out.write(MAGIC + struct.pack("<II", VERSION, len(header_bytes)) + header_bytes)
    out.write(positions.astype("<i8").tobytes())
    for part in parts:
        out.write(_tensor_bytes(part))
    body = out.getvalue()
    return body + struct.pack("<I", zlib.crc32(body))


def decode_state(data: bytes, expected: dict) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Positions and storage parts of a state, after checking it belongs to `expected` (identity etc.)."""
    header, offset = _read_header(data)
    for key, value in expected.items():
        if header.get(key) != value:
            raise StateError(f"state was saved with {key}={header.get(key)!r}, this context has {value!r}")
    n_cells = header["n_cells"]
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
    return positions, parts


def _read_header(data: bytes) -> tuple[dict, int]:
    if len(data) < len(MAGIC) + 12 or not data.startswith(MAGIC):
        raise StateError("not a kvlm sequence state (bad magic or too short)")
    (crc,) = struct.unpack("<I", data[-4:])
    if zlib.crc32(data[:-4]) != crc:
        raise StateError("sequence state is corrupt or truncated (checksum mismatch)")
    version, header_len = struct.unpack_from("<II", data, len(MAGIC))
    if version != VERSION:
        raise StateError(f"sequence state format version {version} is not supported (this kvlm reads {VERSION})")
    start = len(MAGIC) + 8
    return json.loads(_take(data, start, header_len)), start + header_len


def _take(data: bytes, offset: int, size: int) -> bytes:
    if offset + size > len(data) - 4:
        raise StateError(f"sequence state is truncated: needs {offset + size + 4} bytes, has {len(data)}")
    return data[offset : offset + size]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().view(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
