"""A model stored in several GGUF files: llama.cpp's gguf-split parts, or its converter's --split-max-size ones.

Each part is a GGUF file of its own with `split.no` (0-based), `split.count` and `split.tensors.count` (the whole
model's) in its metadata; the first part holds every other key, and the parts are named
PREFIX-00001-of-0000N.gguf ... PREFIX-0000N-of-0000N.gguf. Given any part, every part is opened and checked (its
number, the count, no tensor twice, the tensor total), and the parts are read as one file: each part's tensors at
offsets past the parts before it (`SplitGGUF` answers GGUFFile's questions), so the readers of tensors need not know.
"""
from __future__ import annotations

import bisect
import dataclasses
import re
from pathlib import Path

from kvlm.core.errors import ModelFileError
from kvlm.loader.gguf_reader import GGUFFile, TensorInfo

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
PART_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def open_gguf(path: str | Path) -> GGUFFile | SplitGGUF:
    """The GGUF file at `path`, or, where it is one part of a split model, all of its parts as one."""
    given = GGUFFile(path)
    count = int(given.metadata.get(SPLIT_COUNT, 1))
    if count <= 1:
        return given
    try:
        return SplitGGUF(_open_parts(given, count))
    except BaseException:
        given.close()
        raise


def split_prefix(path: str | Path) -> str | None:
    """PREFIX of a part named PREFIX-0000i-of-0000N.gguf; None for any other name."""
    match = PART_NAME.match(Path(path).name)
    return match["prefix"] if match else None


def part_paths(path: str | Path, count: int) -> list[Path]:
    """The paths of all `count` parts of the split model `path` is a part of (by llama.cpp's naming)."""
    path = Path(path)
    match = PART_NAME.match(path.name)
    if match is None or int(match["count"]) != count:
        raise ModelFileError(f"{path}: this file is one of {count} parts of a split model, but its name does not say "
                             f"where the others are (llama.cpp names them PREFIX-00001-of-{count:05d}.gguf, ...)")
    return [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _open_parts(given: GGUFFile, count: int) -> list[GGUFFile]:
    parts: list[GGUFFile] = []
    try:
        for number, part_path in enumerate(part_paths(given.path, count)):
            if part_path == given.path:
                part = given
            elif not part_path.exists():
                raise ModelFileError(f"{part_path}: part {number + 1} of {count} of the split model is missing")
            else:
                part = GGUFFile(part_path)
            parts.append(part)
            _check_part(part, number, count)
    except BaseException:
        for part in parts:
            if part is not given:
                part.close()
        raise
    return parts


def _check_part(part: GGUFFile, number: int, count: int) -> None:
    found = (part.metadata.get(SPLIT_NO), part.metadata.get(SPLIT_COUNT))
    if found != (number, count):
        raise ModelFileError(f"{part.path}: named part {number + 1} of {count} of a split model, but its metadata says "
                             f"split.no {found[0]} of split.count {found[1]} (parts of different models?)")


class SplitGGUF:
    """The parts of a split model read as one GGUF file: the first part's `metadata`, every part's `tensors` (at
    offsets into the parts laid end to end), `read_into` and `check_complete` sent to the part that holds them."""

    def __init__(self, parts: list[GGUFFile]) -> None:
        self.parts = parts
        self.path = parts[0].path
        self.metadata = parts[0].metadata
        self.bases = [0]
        for part in parts[:-1]:
            self.bases.append(self.bases[-1] + part.size)
        self.tensors: dict[str, TensorInfo] = {}
        for part, base in zip(parts, self.bases):
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise ModelFileError(f"{part.path}: tensor {name} is in two parts of the split model")
                self.tensors[name] = dataclasses.replace(info, offset=base + info.offset)
        expected = self.metadata.get(SPLIT_TENSORS)
        if expected is not None and int(expected) != len(self.tensors):
            raise ModelFileError(f"{self.path}: the split model should hold {expected} tensors "
                                 f"(split.tensors.count), its {len(parts)} parts hold {len(self.tensors)}")

    @property
    def size(self) -> int:
        return self.bases[-1] + self.parts[-1].size

    @property
    def paths(self) -> list[Path]:
        return [part.path for part in self.parts]

    def _part(self, offset: int, nbytes: int) -> tuple[GGUFFile, int]:
        """The part holding bytes offset .. offset + nbytes of the parts laid end to end, and where they start in it."""
        index = bisect.bisect_right(self.bases, offset) - 1
        part, local = self.parts[index], offset - self.bases[index]
        if local + nbytes > part.size:
            raise ModelFileError(f"{part.path}: a read of bytes {local}..{local + nbytes} runs past the part's end "
                                 f"({part.size})")
        return part, local

    def read_into(self, out, offset: int) -> None:
        part, local = self._part(offset, out.numel() * out.element_size() if hasattr(out, "numel") else out.nbytes)
        part.read_into(out, local)

    def mapped(self, offset: int, nbytes: int):
        part, local = self._part(offset, nbytes)
        return part.mapped(local, nbytes)

    def check_complete(self, info: TensorInfo) -> None:
        index = bisect.bisect_right(self.bases, info.offset) - 1
        self.parts[index].check_complete(dataclasses.replace(info, offset=info.offset - self.bases[index]))

    def close(self) -> None:
        for part in self.parts:
            part.close()
