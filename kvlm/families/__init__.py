"""The model families: one module each, listed below one per line, each defining FAMILIES (its Family records, most
often one). They are registered by architecture name in kvlm.core.family, which maps a file's architecture name to
what the decoder needs to know; and a Hugging Face config.json's family is looked up here."""
from __future__ import annotations

from importlib import import_module

from kvlm.core.errors import UnsupportedModelError
from kvlm.core.family import FAMILIES, Family

_MODULES = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "lfm2",
    "mamba2",
    "qwen3moe",
    "qwen2moe",
    "olmoe",
    "granitemoe",
    "gptoss",
    "qwen35",
    "gemma4",
    "smollm3",
    "phi3",
)

for _module in _MODULES:
    FAMILIES.update({family.name: family for family in import_module(f"kvlm.families.{_module}").FAMILIES})
_BY_HF_NAME = {name: family for family in FAMILIES.values()
               for name in (*family.hf_architectures, family.hf_model_type, *family.hf_other_model_types)}

__all__ = ["family_for_hf"]


def family_for_hf(config: dict, where: object) -> Family:
    """The family of a config.json: its `architectures[0]`, else its `model_type`."""
    architectures = config.get("architectures") or [None]
    for name in (architectures[0], config.get("model_type")):
        if isinstance(name, str) and name in _BY_HF_NAME:
            return _BY_HF_NAME[name]
    supported = ", ".join(f"{f.hf_model_type} ({', '.join(f.hf_architectures)})" for f in FAMILIES.values())
    raise UnsupportedModelError(
        f"{where}: architecture {architectures[0]!r} (model_type {config.get('model_type')!r}) is not supported "
        f"(supported: {supported})"
    )
