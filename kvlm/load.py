"""From a model name or path to a ready model: weights on torch plus the file's tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvlm.fetch import DEFAULT_MODEL, resolve_model
from kvlm.loader.config import ModelConfig
from kvlm.loader.gguf_file import load_gguf, read_gguf_config
from kvlm.loader.hf_folder import config_from_hf, load_hf_folder
from kvlm.model.decoder import Decoder, check_settings
from kvlm.tokenizer import Tokenizer


@dataclass
class Model:
    config: ModelConfig
    decoder: Decoder
    tokenizer: Tokenizer
    source: Path


def load_model(
    spec: str = DEFAULT_MODEL, dtype: str = "float32", *, quant: str | None = None, fetch: bool = True,
    progress: bool = True, batch_invariant: bool = False,
) -> Model:
    """`spec` is a known model name (fetched on first use), a .gguf file or a Hugging Face folder.

    `quant` ("int8" or "int4", with dtype "bfloat16") keeps the layer weights quantized for speed;
    `batch_invariant` (float32) makes logits independent of the batch (see `Decoder`).
    """
    check_settings(dtype, quant, batch_invariant)
    source = resolve_model(spec, fetch=fetch, progress=progress)
    if source.is_dir():
        config, weights = load_hf_folder(source)
        tokenizer = Tokenizer.from_hf_folder(source)
    else:
        config, weights, metadata = load_gguf(source)
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    return Model(config, Decoder(config, weights, dtype, quant, batch_invariant), tokenizer, source)


def load_config(spec: str = DEFAULT_MODEL, *, fetch: bool = True, progress: bool = True) -> ModelConfig:
    """The config alone, without reading any weights."""
    source = resolve_model(spec, fetch=fetch, progress=progress)
    return config_from_hf(source) if source.is_dir() else read_gguf_config(source)
