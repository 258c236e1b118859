"""transformers' readings of the real model files, kept between runs outside the repo (`$KVLM_HOME/references`):
reading a GGUF through transformers dequantizes every tensor in NumPy (over a minute for Qwen2.5-0.5B on two cores),
so its model is saved once as a Hugging Face folder and read back from there (its tokenizer is read from the
file each time). The key is the file's sha256 and the
versions of transformers, torch and gguf: another file or another reader makes another reading. What a reference
model then generates greedily is kept too, under the same key and the exact inputs and settings asked. What each test
compares is unchanged: transformers' own reading of the file, and its own generate."""
from __future__ import annotations

import hashlib
import json
import shutil
from functools import cache
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_model

from kvlm.home import kvlm_home

READER = {name: version(name) for name in ("transformers", "torch", "gguf")}


@cache
def file_key(path: Path) -> str:
    """The file's sha256 (first 16 hex digits) and the readers' versions, as one folder name."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    readers = "-".join(f"{name}{v}" for name, v in READER.items())
    return f"{path.stem}-{digest.hexdigest()[:16]}-{readers}".replace("+", "_")


def _kept(folder: Path, read, save) -> object:
    """What `read(folder)` gives from the folder where it is complete, else `save(folder)` writes it first (into a
    temporary folder renamed when done, so that an interrupted run leaves nothing half written)."""
    if not (folder / "DONE").exists():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save(partial)
        (partial / "DONE").write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return read(folder)


def reference_model(gguf_path: Path):
    """transformers' float32 reading of the GGUF file (from the kept folder after the first run), its greedy
    `generate` kept too."""
    folder = kvlm_home() / "references" / file_key(gguf_path) / "model"

    def save(partial: Path) -> None:
        """transformers refuses save_pretrained for a model it read from GGUF: its config and weights written as a
        folder's are (safetensors' save_model keeps a tied tensor once)."""
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                                  dtype=torch.float32)
        if hasattr(model.config, "quantization_config"):  # the blocks it came from, not what the folder holds
            del model.config.quantization_config
        model.config.save_pretrained(partial)
        model.generation_config.save_pretrained(partial)
        save_model(model, str(partial / "model.safetensors"))

    model = _kept(folder, lambda f: transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32), save)
    model.generate = KeptGenerate(model, folder.parent / "generate")
    return model.eval()


def reference_tokenizer(gguf_path: Path):
    """transformers' tokenizer as it reads the GGUF file, read each time: a saved copy read back tokenizes some
    text otherwise (Qwen2.5's, on random text), so it is no reference."""
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


class KeptGenerate:
    """The model's own `generate` for greedy calls with input ids and plain settings, each answer kept by its exact
    inputs, keyword arguments and the model's generation config; anything else goes straight through."""

    KEPT = {"max_new_tokens", "min_new_tokens", "do_sample", "eos_token_id", "pad_token_id"}

    def __init__(self, model, folder: Path) -> None:
        self.generate, self.model, self.folder = model.generate, model, folder

    def __call__(self, input_ids: torch.Tensor, **kwargs):
        if kwargs.get("do_sample", False) or set(kwargs) - self.KEPT or input_ids.shape[0] != 1:
            return self.generate(input_ids, **kwargs)
        asked = json.dumps({"ids": input_ids.tolist(), "kwargs": kwargs,
                            "config": self.model.generation_config.to_dict()}, sort_keys=True, default=str)
        path = self.folder / f"{hashlib.sha256(asked.encode()).hexdigest()[:24]}.json"
        if path.exists():
            return torch.tensor(json.loads(path.read_text())["output"])
        output = self.generate(input_ids, **kwargs)
        self.folder.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps({"asked": json.loads(asked), "output": output.tolist()}))
        path.with_suffix(".tmp").rename(path)
        return output
