"""Reading GGUF metadata into plain Python values."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from kvlm.errors import ModelFileError


def open_gguf(path: str | Path) -> GGUFReader:
    """Open a GGUF file, turning the reader's low-level failures into a ModelFileError naming the file."""
    try:
        return GGUFReader(str(path), "r")
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such GGUF file") from None
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors on damaged files
        raise ModelFileError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def metadata_of(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field of the file as str, int, float, bool or list of those."""
    values: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        values[name] = _field_value(field)
    return values


def _field_value(field) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    return metadata_of(open_gguf(path))
