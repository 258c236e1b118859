"""Models from the Hugging Face Hub by name, as llama.cpp's `-hf` and Ollama's `hf.co/` take them.

    user/repo[@revision][:QUANT]     (also hf.co/user/repo:QUANT, https://huggingface.co/user/repo)

A repository of GGUF files gives one model file: the one whose name carries the quant tag (case-insensitive,
between separators: "Q4_K_M" picks "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", not "...-IQ4_K_M..." nor "...-Q4_K_M_L..."),
by default Q4_K_M, else the first; a split file comes with all its parts; vision projectors (mmproj) are never
chosen. A repository of safetensors with a config.json gives its folder (weights, config, tokenizer files).

Downloads go through huggingface_hub, into its cache (HF_HOME, HF_HUB_CACHE), with what it brings: resumed
transfers, HF_TOKEN for gated and private repositories, HF_ENDPOINT, HF_HUB_OFFLINE. A model already in the cache
is used without asking the Hub when the Hub cannot be reached or HF_HUB_OFFLINE is set.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from kvlm.core.errors import ModelFetchError
from kvlm.loader.gguf_split import PART_NAME

HUB_NAME = re.compile(r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)"
                      r"(?:@(?P<revision>[\w./-]+?))?(?::(?P<tag>[\w.-]+))?$")
DEFAULT_TAG = "Q4_K_M"
# the quant tags of file names, for telling a user which a repository has
QUANT_TAG = re.compile(r"(?:^|[-._/])((?:I?Q\d|TQ\d)(?:_[A-Z0-9]+)*|BF16|F16|F32|MXFP4(?:_MOE)?)(?=[-./]|$)",
                       re.IGNORECASE)
# what a folder model needs of a repository of safetensors
FOLDER_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt"]


@dataclass(frozen=True)
class HubName:
    repo: str
    tag: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{self.repo}{at}:{self.tag}" if self.tag else f"{self.repo}{at}"


def parse_hub_name(spec: str) -> HubName | None:
    """The repository, quant tag and revision a model name gives; None where it is no Hub name."""
    match = HUB_NAME.match(spec.strip())
    if match is None or match["repo"].lower().endswith(".gguf"):  # (a file's path, not a repository)
        return None
    return HubName(match["repo"], match["tag"], match["revision"])


def pull_from_hub(name: HubName, progress: bool = True, download: bool = True) -> Path:
    """The local path of the model `name` gives (downloaded where needed): a .gguf file (a split one's first
    part, the others beside it) or a folder. `download` False: from the cache only."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    if not download:
        return _from_cache(name, "downloads were not asked for")
    try:
        files = _call(lambda: HfApi().list_repo_files(name.repo, revision=name.revision), name)
    except _Unreachable as exc:
        return _from_cache(name, str(exc))
    chosen = choose_files(files, name)
    try:
        with _progress(progress):
            if chosen is FOLDER_FILES:
                return Path(_call(lambda: snapshot_download(name.repo, revision=name.revision,
                                                            allow_patterns=FOLDER_FILES), name))
            paths = [_call(lambda file=file: hf_hub_download(name.repo, file, revision=name.revision), name)
                     for file in chosen]
    except _Unreachable as exc:
        raise ModelFetchError(f"could not download {name}: {exc}") from None
    return Path(paths[0])


def choose_files(files: list[str], name: HubName) -> list[str]:
    """The repository files the model is: its GGUF file's (all parts of a split one), or FOLDER_FILES for a
    repository of safetensors."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in Path(f).name.lower())
    if not ggufs:
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            if name.tag:
                raise ModelFetchError(f"{name.repo} holds safetensors weights, not GGUF files: it has no quant tag "
                                      f"{name.tag!r} to choose (ask for {name.repo} alone)")
            return FOLDER_FILES
        raise ModelFetchError(f"{name.repo} holds no GGUF file and no config.json with safetensors weights: "
                              "nothing kvlm can load")
    matching = [f for f in ggufs if has_tag(f, name.tag or DEFAULT_TAG)]
    if not matching:
        if name.tag:
            raise ModelFetchError(f"{name.repo} has no GGUF file for the tag {name.tag!r}; its tags: "
                                  f"{', '.join(repo_tags(ggufs)) or 'none recognised'} (files: {', '.join(ggufs)})")
        matching = ggufs  # no Q4_K_M: the first file, as llama.cpp's -hf
    return _with_parts(matching[0], ggufs)


def has_tag(file: str, tag: str) -> bool:
    """Whether the repository path `file` carries `tag` in its name or its folder's, between separators."""
    return re.search(rf"(?:^|[-._/]){re.escape(tag)}(?:[-./]|$)", file, re.IGNORECASE) is not None


def repo_tags(ggufs: list[str]) -> list[str]:
    tags = {match.group(1).upper() for f in ggufs for match in QUANT_TAG.finditer(f)}
    return sorted(tags)


def _with_parts(file: str, ggufs: list[str]) -> list[str]:
    """`file` and, where it is a part of a split model, all the parts (in order)."""
    match = PART_NAME.match(Path(file).name)
    if match is None:
        return [file]
    count = int(match["count"])
    parts = [str(Path(file).with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf")) for i in range(1, count + 1)]
    missing = [p for p in parts if p not in ggufs]
    if missing:
        raise ModelFetchError(f"the split model {file} lacks parts in its repository: {', '.join(missing)}")
    return parts


class _Unreachable(Exception):
    """The Hub could not be asked (no network, HF_HUB_OFFLINE): the cache may still have the model."""


def _call(thunk, name: HubName):
    """`thunk()`, a call of huggingface_hub's, its failures told in one sentence."""
    from huggingface_hub import errors

    try:
        return thunk()
    except errors.GatedRepoError:
        raise ModelFetchError(f"{name.repo} is gated: accept its terms on the Hub, then set HF_TOKEN to a token of "
                              "that account") from None
    except errors.RepositoryNotFoundError:
        raise ModelFetchError(f"there is no model repository {name.repo} on the Hub ({_endpoint()}), or it is "
                              "private and HF_TOKEN is not set to a token that may read it (nor is there a file or "
                              f"folder {name.repo} here)") from None
    except errors.RevisionNotFoundError:
        raise ModelFetchError(f"{name.repo} has no revision {name.revision!r}") from None
    except errors.OfflineModeIsEnabled:
        raise _Unreachable("HF_HUB_OFFLINE is set") from None
    except errors.HfHubHTTPError as exc:
        raise ModelFetchError(f"the Hub ({_endpoint()}) refused {name}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:  # (httpx's errors are not OSErrors; see below)
        raise ModelFetchError(f"could not download {name}: {exc}") from exc
    except Exception as exc:
        if type(exc).__module__.startswith(("httpx", "httpcore")):
            raise _Unreachable(f"the Hub ({_endpoint()}) cannot be reached: {type(exc).__name__}: {exc}") from None
        raise


def _from_cache(name: HubName, reason: str) -> Path:
    """The model as far as the cache has it (the files of the revision last downloaded)."""
    from huggingface_hub import errors, snapshot_download

    try:
        folder = Path(snapshot_download(name.repo, revision=name.revision, local_files_only=True))
    except (errors.LocalEntryNotFoundError, FileNotFoundError):
        raise ModelFetchError(f"{name} is not in the Hugging Face cache and cannot be downloaded ({reason})") from None
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    try:
        chosen = choose_files(files, name)
    except ModelFetchError as exc:
        raise ModelFetchError(f"{name} is only partly in the Hugging Face cache ({reason}): {exc}") from None
    return folder if chosen is FOLDER_FILES else folder / chosen[0]


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


@contextlib.contextmanager
def _progress(shown: bool):
    """huggingface_hub's progress bars, on or off for the downloads inside."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not shown:
        disable_progress_bars()
    try:
        yield
    finally:
        if not shown and not was_disabled:
            enable_progress_bars()
