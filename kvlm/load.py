"""From a model name or path to a ready model: weights on torch plus the file's tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvlm import pack_cache
from kvlm.fetch import DEFAULT_MODEL, resolve_model
from kvlm.loader.config import ModelConfig
from kvlm.loader.gguf_file import load_gguf, read_gguf_summary
from kvlm.loader.hf_folder import config_from_hf, load_hf_folder
from kvlm.model.decoder import Decoder
from kvlm.model.graphs import StepGraphs, check_compiler
from kvlm.model.settings import AUTO, resolve_settings
from kvlm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvlm.parallel.leader import Leader


@dataclass
class Model:
    config: ModelConfig
    decoder: Decoder
    tokenizer: Tokenizer
    source: Path
    graphs: StepGraphs | None = None  # compiled decode and prefill steps, when loaded with compile=True
    tensor_parallel: Leader | None = None  # the other ranks, when loaded with tensor_parallel_size > 1


def load_model(
    spec: str = DEFAULT_MODEL, dtype: str = AUTO, *, quant: str | None = AUTO, fetch: bool = True,
    progress: bool = True, batch_invariant: bool = False, compile: bool = False, tensor_parallel_size: int = 1,
) -> Model:
    """`spec` is a known model name (fetched on first use), a .gguf file or a Hugging Face folder.

    The defaults are the fast setting for this CPU (see kvlm.model.settings): bfloat16 where it has native
    bf16 instructions, each matrix as precise as its file stores it. `dtype="float32"` is the reference
    mode; `quant` ("int8" or "int4") quantizes every layer matrix; `batch_invariant` (float32) makes logits
    independent of the batch (see `Decoder`). `compile` runs decode steps and prompt chunks through graphs
    compiled by torch.compile (see kvlm.model.graphs). `tensor_parallel_size` N > 1 splits every layer's heads
    and MLP width over N processes (see kvlm.parallel): this one is rank 0 and starts the others.
    """
    if compile and batch_invariant:
        raise ValueError("compile and batch_invariant exclude each other: compiled graphs sum in the order their "
                         "shapes suit, so a batch-invariant model runs eagerly")
    if compile and tensor_parallel_size != 1:
        raise ValueError("compile and tensor parallelism exclude each other: a compiled graph cannot stop at each "
                         "rank's all-reduce; a tensor-parallel model runs eagerly")
    if compile:
        check_compiler()
    settings = resolve_settings(dtype, quant, batch_invariant)
    if tensor_parallel_size != 1:
        from kvlm.parallel.launch import load_tensor_parallel  # torch.distributed loads only for this

        return load_tensor_parallel(spec, tensor_parallel_size, settings, fetch, progress)
    model = _load(spec, settings, fetch, progress)
    if compile:
        model.graphs = StepGraphs(model.decoder)
    return model


def _load(spec: str, settings, fetch: bool, progress: bool) -> Model:
    source = resolve_model(spec, fetch=fetch, progress=progress)
    cached = pack_cache.load(source, settings)
    if cached is not None:
        return Model(**cached, source=source)
    config, weights, tokenizer = read_model(source)
    model = Model(config, Decoder(config, weights, settings), tokenizer, source)
    pack_cache.save(source, settings, {"config": config, "decoder": model.decoder, "tokenizer": tokenizer})
    return model


def read_model(source: Path):
    """The config, float32 weights and tokenizer of a GGUF file or Hugging Face folder."""
    if source.is_dir():
        config, weights = load_hf_folder(source)
        return config, weights, Tokenizer.from_hf_folder(source)
    config, weights, metadata = load_gguf(source)
    return config, weights, Tokenizer.from_gguf_metadata(metadata)


def load_summary(spec: str = DEFAULT_MODEL, *, fetch: bool = True,
                 progress: bool = True) -> tuple[ModelConfig, dict[str, str]]:
    """The config and how the file stores each tensor (GGUF type names; empty for a Hugging Face folder)."""
    source = resolve_model(spec, fetch=fetch, progress=progress)
    return (config_from_hf(source), {}) if source.is_dir() else read_gguf_summary(source)
