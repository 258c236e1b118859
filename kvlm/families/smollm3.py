"""SmolLM3: a Llama (GQA, SwiGLU, tied embeddings) whose every fourth layer attends without RoPE ("NoPE").

config.json lists the layers that rotate (`no_rope_layers`: 1 rotates, 0 does not; transformers derives it from
`no_rope_layer_interval`, 4, when absent); llama.cpp's GGUF files do not say: it takes every fourth layer, as the
released models have it. Its converter is Llama's, so Q and K rows are permuted as Llama's."""
from __future__ import annotations

from kvlm.core.family import Family

_GGUF_INTERVAL = 4  # llama.cpp's n_no_rope_layer_step for smollm3


def _unrotated(flags) -> dict:
    return {"unrotated_layers": tuple(i for i, rotates in enumerate(flags) if not rotates)}


def hf_options(raw: dict) -> dict:
    """The layers without RoPE as transformers' SmolLM3Config reads them."""
    interval = raw.get("no_rope_layer_interval") or 4
    flags = raw.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(raw["num_hidden_layers"])]
    return _unrotated(flags)


def gguf_options(key, tensor_names: frozenset[str]) -> dict:
    """The layers without RoPE as llama.cpp's smollm3 takes them."""
    return _unrotated((i + 1) % _GGUF_INTERVAL != 0 for i in range(int(key("block_count"))))


FAMILY = Family(name="smollm3", hf_architectures=("SmolLM3ForCausalLM",), hf_model_type="smollm3", permuted_qk=True,
                hf_options=hf_options, gguf_options=gguf_options)

FAMILIES = (FAMILY,)
