"""What models are on this machine, and freeing them: kvlm's own cache of the known names ($KVLM_HOME/models) and
the Hugging Face cache (HF_HOME, HF_HUB_CACHE), which `--model user/repo[:QUANT]` downloads into; and the tiles files
their starts keep (kvlm.loader.tile_cache), removed with them."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from kvlm.core.errors import ModelFetchError
from kvlm.loader.fetch import KNOWN_MODELS, cached_model_path
from kvlm.loader.gguf_split import PART_NAME
from kvlm.loader.hub import HubName, has_tag, parse_hub_name, repo_tags
from kvlm.loader.tile_cache import tiles_of


@dataclass(frozen=True)
class CachedModel:
    name: str  # what --model takes to use it
    size: int  # bytes on disk
    where: Path
    files: tuple[Path, ...]  # what a load reads (a split model's parts, a folder's safetensors files)


def cached_models() -> list[CachedModel]:
    """Every model in either cache: the known names downloaded, and each GGUF model (a split one once) or folder
    model of each Hugging Face repository cached."""
    models = [CachedModel(name, path.stat().st_size, path, (path,)) for name in sorted(KNOWN_MODELS)
              if (path := cached_model_path(name)).is_file()]
    for repo in _hub_repos():
        files = {_in_repo(f, revision): f for revision in repo.revisions for f in revision.files}
        ggufs = sorted(name for name in files if name.lower().endswith(".gguf") and "mmproj" not in name.lower())
        for gguf in ggufs:
            match = PART_NAME.match(Path(gguf).name)
            if match and int(match["no"]) != 1:
                continue  # a split model is listed by its first part, with the size of all of them
            parts = [g for g in ggufs if _same_split(g, gguf)] if match else [gguf]
            tags = repo_tags([gguf])
            name = f"{repo.repo_id}:{tags[0]}" if len(tags) == 1 else f"{repo.repo_id}:{gguf}"
            models.append(CachedModel(name, sum(files[p].size_on_disk for p in parts), files[gguf].file_path,
                                      tuple(files[p].file_path for p in parts)))
        if not ggufs and "config.json" in files:
            tensors = tuple(f.file_path for f in files.values() if f.file_path.suffix == ".safetensors")
            models.append(CachedModel(repo.repo_id, repo.size_on_disk, repo.repo_path, tensors))
    return models


def remove_model(spec: str) -> list[Path]:
    """Free what `spec` names: a known name's file; a repository's files for a quant tag; a whole repository; and
    the tiles files made from them. Returns what was removed; ModelFetchError where nothing is cached under that
    name."""
    if spec in KNOWN_MODELS:
        path = cached_model_path(spec)
        if not path.exists():
            raise ModelFetchError(f"{spec} is not downloaded (looked for {path})")
        tiles = _remove_tiles([path])
        shutil.rmtree(path.parent)
        return [path.parent, *tiles]
    name = parse_hub_name(spec)
    repo = next((r for r in _hub_repos() if name is not None and r.repo_id == name.repo), None)
    if repo is None:
        raise ModelFetchError(f"nothing is cached under {spec!r} (`kvlm ls` lists what is)")
    if name.tag is None:
        tiles = _remove_tiles([f.file_path for revision in repo.revisions for f in revision.files])
        shutil.rmtree(repo.repo_path)
        return [repo.repo_path, *tiles]
    return _remove_tagged(repo, name)


def _remove_tiles(model_files: list[Path]) -> list[Path]:
    """Deletes the tiles files made from any of these model files (while they still resolve); returns them."""
    tiles = [kept.path for kept in tiles_of(model_files)]
    for path in tiles:
        path.unlink(missing_ok=True)
    return tiles


def _remove_tagged(repo, name: HubName) -> list[Path]:
    """The cached files of one quant tag: their links in every snapshot, and their blobs where no other link is
    left."""
    files = [f for revision in repo.revisions for f in revision.files if has_tag(_in_repo(f, revision), name.tag)]
    if not files:
        raise ModelFetchError(f"no file of {name.repo} for the tag {name.tag!r} is cached")
    tiles = _remove_tiles([f.file_path for f in files])
    for f in files:
        f.file_path.unlink()
    kept = {f.blob_path for revision in repo.revisions for f in revision.files if f not in files}
    for blob in {f.blob_path for f in files} - kept:
        blob.unlink(missing_ok=True)
    return [f.file_path for f in files] + tiles


def _same_split(file: str, first: str) -> bool:
    """Whether `file` is a part of the split model whose first part is `first`."""
    a, b = PART_NAME.match(Path(file).name), PART_NAME.match(Path(first).name)
    return a is not None and Path(file).parent == Path(first).parent and (a["prefix"], a["count"]) == (
        b["prefix"], b["count"])


def _in_repo(file, revision) -> str:
    """A cached file's path in its repository."""
    return str(file.file_path.relative_to(revision.snapshot_path))


def _hub_repos() -> list:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return sorted((r for r in scan_cache_dir().repos if r.repo_type == "model"), key=lambda r: r.repo_id)
    except CacheNotFound:
        return []
