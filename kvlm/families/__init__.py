"""The model families, registered by architecture name in kvlm.core.family (which maps a file's architecture name to
what the decoder needs to know); and the lookup of a Hugging Face config.json's family."""
from __future__ import annotations

from kvlm.core.errors import UnsupportedModelError
from kvlm.core.family import FAMILIES, Family
from kvlm.families import (gemma3, gemma4, gptoss, granitemoe, lfm2, llama, mamba2, olmoe, qwen2, qwen2moe, qwen3, qwen3moe,
                           qwen35)

FAMILIES.update({
    family.name: family for family in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY, lfm2.FAMILY,
                                       mamba2.FAMILY, qwen3moe.FAMILY, qwen2moe.FAMILY, olmoe.FAMILY,
                                       granitemoe.FAMILY, gptoss.FAMILY, qwen35.FAMILY, qwen35.MOE_FAMILY,
                                       gemma4.FAMILY)
})
_BY_HF_NAME = {
    name: family for family in FAMILIES.values() for name in (*family.hf_architectures, family.hf_model_type)
} | {"mixtral": llama.FAMILY, "granitemoeshared": granitemoe.FAMILY,  # model types of a family's second architecture
     "qwen3_5": qwen35.FAMILY, "qwen3_5_moe": qwen35.MOE_FAMILY, "gemma4": gemma4.FAMILY}

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
