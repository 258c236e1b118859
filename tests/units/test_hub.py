"""Models from the Hub by name (kvlm.loader.hub), against a stand-in Hub on 127.0.0.1 (tests/helpers/fake_hub.py)
that huggingface_hub talks to as to the real one: a quant tag picks its file (case-insensitive, Q4_K_M by default,
else the first), a split model comes whole, a safetensors repository as a folder; a missing tag, repository or
revision and a gated repository each get one clear sentence; offline, the cache answers; a dropped download
resumes with a byte range; `kvlm pull` and `generate` (offline, from the cache) from the command line.
Nothing here reaches the real Hub."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from helpers.fake_hub import FakeHub
from helpers.family_factory import SPECS, family_gguf_metadata, family_gguf_tensors, random_model
from helpers.gguf_factory import write_gguf
from kvlm.core.errors import ModelFetchError
from kvlm.loader.fetch import resolve_model
from kvlm.loader.hub import HubName, choose_files, parse_hub_name, pull_from_hub
from kvlm.loader import tile_cache
from kvlm.loader.model_cache import cached_models, remove_model

SPEC = SPECS["llama-llama3"]
REPO = "someone/tiny-llama-GGUF"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """A random model's GGUF bytes as Q8_0 and F32 files, and its Q8_0 file in three parts."""
    folder = tmp_path_factory.mktemp("hubfiles")
    model = random_model(SPEC)
    metadata, tensors = family_gguf_metadata(model, SPEC), family_gguf_tensors(model, SPEC)
    q8 = write_gguf(folder / "q8.gguf", metadata, tensors, arch=SPEC.arch, quant=GGMLQuantizationType.Q8_0)
    f32 = write_gguf(folder / "f32.gguf", metadata, tensors, arch=SPEC.arch)
    (folder / "split").mkdir()
    first = write_gguf(folder / "split" / "big.gguf", metadata, tensors, arch=SPEC.arch,
                       quant=GGMLQuantizationType.Q8_0, split_max_tensors=6)
    parts = {p.name: p.read_bytes() for p in sorted(first.parent.glob("big-*.gguf"))}
    return {"q8": q8.read_bytes(), "f32": f32.read_bytes(), "parts": parts}


@pytest.fixture
def hub(tmp_path, monkeypatch, model_files):
    """The stand-in Hub, huggingface_hub pointed at it (its settings are read at import, so patched where they
    live) with a cache of this test's own."""
    from huggingface_hub import constants

    fake = FakeHub()
    fake.add(REPO, {"tiny-llama-Q8_0.gguf": model_files["q8"], "tiny-llama-F32.gguf": model_files["f32"],
                    "mmproj-tiny-Q8_0.gguf": b"not a model", "README.md": b"# tiny"})
    fake.add("someone/split-GGUF", {f"Q8_0/{name}": data for name, data in model_files["parts"].items()})
    fake.add("someone/gated-GGUF", {"m-Q4_K_M.gguf": model_files["q8"]}, gated=True)
    url = fake.start()
    for name, value in (("ENDPOINT", url), ("HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"),
                        ("HF_HUB_CACHE", str(tmp_path / "hf")), ("HF_HUB_OFFLINE", False)):
        monkeypatch.setattr(constants, name, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    fake.url, fake.cache = url, tmp_path / "hf"
    yield fake
    fake.stop()


def test_hub_names_are_read_as_llama_cpp_and_ollama_write_them():
    assert parse_hub_name("Qwen/Qwen2.5-0.5B-Instruct-GGUF") == HubName("Qwen/Qwen2.5-0.5B-Instruct-GGUF")
    assert parse_hub_name("unsloth/gpt-oss-20b-GGUF:q4_k_m") == HubName("unsloth/gpt-oss-20b-GGUF", "q4_k_m")
    assert parse_hub_name("hf.co/bartowski/SmolLM2-GGUF:IQ4_XS") == HubName("bartowski/SmolLM2-GGUF", "IQ4_XS")
    assert parse_hub_name("https://huggingface.co/a/b@v1.0:Q8_0") == HubName("a/b", "Q8_0", "v1.0")
    assert parse_hub_name("model.gguf") is None and parse_hub_name("a/b/c") is None


def test_the_tag_picks_the_file_between_separators():
    files = ["x-IQ4_XS.gguf", "x-Q4_K_M.gguf", "x-Q4_K_S.gguf", "x-Q8_0.gguf", "mmproj-x-Q4_K_M.gguf", "x.Q6_K.gguf"]
    assert choose_files(files, HubName("a/b")) == ["x-Q4_K_M.gguf"]  # the default tag
    assert choose_files(files, HubName("a/b", "q4_k_s")) == ["x-Q4_K_S.gguf"]
    assert choose_files(files, HubName("a/b", "Q6_K")) == ["x.Q6_K.gguf"]
    assert choose_files(["b-Q8_0.gguf", "a-F16.gguf"], HubName("a/b")) == ["a-F16.gguf"]  # no Q4_K_M: the first
    with pytest.raises(ModelFetchError, match=r"no GGUF file for the tag 'Q2_K'; its tags: IQ4_XS, Q4_K_M, Q4_K_S, "
                                              r"Q6_K, Q8_0"):
        choose_files(files, HubName("a/b", "Q2_K"))


def test_a_tag_pulls_its_file_and_the_model_runs_offline_from_the_cache(hub, monkeypatch):
    from huggingface_hub import constants

    path = resolve_model(f"{REPO}:q8_0", progress=False)
    assert path.name == "tiny-llama-Q8_0.gguf" and path.read_bytes() == hub.repos[REPO].files[path.name]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model(f"{REPO}:Q8_0", progress=False) == path
    with pytest.raises(ModelFetchError, match=r"only partly in the Hugging Face cache \(HF_HUB_OFFLINE is set\): "
                                              r".*no GGUF file for the tag 'F32'"):
        resolve_model(f"{REPO}:F32", progress=False)
    with pytest.raises(ModelFetchError, match=r"someone/other is not in the Hugging Face cache and cannot be "
                                              r"downloaded \(HF_HUB_OFFLINE is set\)"):
        resolve_model("someone/other", progress=False)


def test_a_split_model_comes_with_all_its_parts(hub):
    path = resolve_model("someone/split-GGUF:Q8_0", progress=False)
    parts = sorted(path.parent.glob("big-*.gguf"))
    assert path == parts[0] and len(parts) == len(hub.repos["someone/split-GGUF"].files) >= 3


def test_a_safetensors_repository_comes_as_a_folder(hub, tmp_path):
    hub.add("someone/tiny-safetensors", {"config.json": b"{}", "model.safetensors": b"x", "tokenizer.json": b"{}",
                                         "optimizer.pt": b"not needed"})
    folder = pull_from_hub(HubName("someone/tiny-safetensors"), progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    with pytest.raises(ModelFetchError, match="holds safetensors weights, not GGUF files"):
        pull_from_hub(HubName("someone/tiny-safetensors", "Q4_K_M"), progress=False)


@pytest.mark.parametrize("spec, message", [
    ("someone/missing", r"there is no model repository someone/missing on the Hub \(http://127.0.0.1"),
    ("someone/gated-GGUF", r"someone/gated-GGUF is gated: accept its terms on the Hub, then set HF_TOKEN"),
    ("someone/tiny-llama-GGUF@v9", r"someone/tiny-llama-GGUF has no revision 'v9'"),
    ("someone/tiny-llama-GGUF:Q5_K_M", r"has no GGUF file for the tag 'Q5_K_M'; its tags: F32, Q8_0"),
])
def test_what_cannot_be_had_is_one_clear_sentence(hub, spec, message):
    with pytest.raises(ModelFetchError, match=message):
        resolve_model(spec, progress=False)


def test_a_dropped_download_resumes_where_it_stopped(hub, monkeypatch):
    """A connection lost mid-file: huggingface_hub asks for the rest with a byte range (from the last whole chunk it
    wrote; chunks made small here so a small file has several)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    hub.cut_once["tiny-llama-Q8_0.gguf"] = 5000
    path = resolve_model(f"{REPO}:Q8_0", progress=False)
    assert path.read_bytes() == hub.repos[REPO].files["tiny-llama-Q8_0.gguf"]
    gets = [r for method, p, r in hub.requests if method == "GET" and p.endswith("tiny-llama-Q8_0.gguf")]
    assert gets == [None, "bytes=4096-"]


def test_cached_models_are_listed_and_removed_with_their_tiles(hub, tmp_path, monkeypatch):
    q8 = resolve_model(f"{REPO}:Q8_0", progress=False)
    f32 = resolve_model(f"{REPO}:F32", progress=False)
    resolve_model("someone/split-GGUF:Q8_0", progress=False)
    monkeypatch.setenv(tile_cache.DIRECTORY_VARIABLE, str(tmp_path / "tiles"))
    for name, model in (("q8", q8), ("f32", f32)):  # as a start would keep them (named by the resolved blob path)
        tile_cache.write_tiles(tmp_path / "tiles" / f"{name}.tiles", {}, 1 << 20, [str(model.resolve())])
    listed = {m.name: m.size for m in cached_models() if m.name.startswith("someone/")}
    split_size = sum(map(len, hub.repos["someone/split-GGUF"].files.values()))
    assert listed == {f"{REPO}:Q8_0": len(hub.repos[REPO].files["tiny-llama-Q8_0.gguf"]),
                      f"{REPO}:F32": len(hub.repos[REPO].files["tiny-llama-F32.gguf"]),
                      "someone/split-GGUF:Q8_0": split_size}
    assert [t.path.name for t in tile_cache.tiles_of([f32])] == ["f32.tiles"]
    removed = remove_model(f"{REPO}:F32")
    assert [p.name for p in removed] == ["tiny-llama-F32.gguf", "f32.tiles"]
    assert [t.path.name for t in tile_cache.kept_tiles()] == ["q8.tiles"]
    assert {m.name for m in cached_models() if m.name.startswith("someone/")} == {f"{REPO}:Q8_0",
                                                                                  "someone/split-GGUF:Q8_0"}
    remove_model("someone/split-GGUF")
    assert {m.name for m in cached_models() if m.name.startswith("someone/")} == {f"{REPO}:Q8_0"}
    with pytest.raises(ModelFetchError, match="nothing is cached under 'someone/nothing'"):
        remove_model("someone/nothing")


def test_the_command_line_pulls_and_generates_offline(hub, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cli-hf"), "HF_HUB_OFFLINE": "0"}
    kvlm = str(Path(sys.executable).parent / "kvlm")
    run = lambda *args, **extra: subprocess.run([kvlm, *args], env={**env, **extra},  # noqa: E731
                                                capture_output=True, text=True, timeout=300)
    pulled = run("pull", f"{REPO}:Q8_0")
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip().endswith("tiny-llama-Q8_0.gguf")
    generated = run("generate", "--model", f"{REPO}:Q8_0", "--prompt", "hello", "--max-tokens", "3", "--json",
                    HF_HUB_OFFLINE="1")
    assert generated.returncode == 0, generated.stderr
