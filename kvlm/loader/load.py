"""From a model name or path to a ready model, in one path:

    name -> file (fetch) -> header: config, every tensor checked, nothing read (gguf_file / hf_folder)
         -> memory plan: weights + KV against what this process has (memory_plan)
         -> tensors streamed one at a time into their kernels' form (Decoder) -> tokenizer -> Model

A tensor-parallel model is the same path on every rank, each reading only its shard (shard.py); the ranks are
started by kvlm.parallel, which knows nothing of files.
"""
from __future__ import annotations

import functools
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvlm.kernels import native_kernels
from kvlm.core.config import ModelConfig
from kvlm.loader.fetch import DEFAULT_MODEL, resolve_model
from kvlm.loader.gguf_file import open_gguf_model, read_gguf_summary
from kvlm.loader.hf_folder import config_from_hf, open_hf_folder
from kvlm.loader.memory_plan import (
    MemoryPlan,
    MemoryRequest,
    fit,
    plan_memory,
    weight_bytes,
)
from kvlm.loader.shard import check_tensor_parallel, make_shard
from kvlm.loader.tile_cache import DIRECTORY_VARIABLE as TILES_VARIABLE
from kvlm.loader.tile_cache import TileCache, tile_cache_for
from kvlm.loader.weights import ModelWeights
from kvlm.model.decoder import Decoder
from kvlm.model.graphs import StepGraphs, check_compiler
from kvlm.model.settings import AUTO, FROM_FILE, ComputeSettings, resolve_settings
from kvlm.text.tokenizer import Tokenizer


@dataclass
class Model:
    config: ModelConfig
    decoder: Decoder
    tokenizer: Tokenizer
    source: Path
    plan: MemoryPlan | None = None  # the memory planned when it was loaded (None for a tensor-parallel worker)
    graphs: StepGraphs | None = None  # compiled decode and prefill steps, when loaded with compile=True
    tensor_parallel: Any = None  # the other ranks (kvlm.parallel.leader.Leader), with tensor_parallel_size > 1


def load_model(
    spec: str = DEFAULT_MODEL, dtype: str = AUTO, *, quant: str | None = AUTO, fetch: bool = True,
    progress: bool = True, batch_invariant: bool = False, compile: bool = False, tensor_parallel_size: int = 1,
    memory: MemoryRequest | None = None, memory_budget: int | None = None, device: str = AUTO,
) -> Model:
    """`spec` is a known model name (fetched on first use), a .gguf file or a Hugging Face folder.

    The defaults are the fast setting for this CPU (see kvlm.model.settings): bfloat16 where it has native
    bf16 instructions, each matrix kept in the blocks its file stores it in. `dtype="float32"` is the reference
    mode; `quant` ("int8" or "int4") requantizes every layer matrix. Every mode but the reference one is
    batch-invariant (see `Decoder`); `batch_invariant` makes the reference mode so too. `compile` runs decode
    steps and prompt chunks through graphs compiled by torch.compile (see kvlm.model.graphs), which gives batch
    invariance up. `tensor_parallel_size` N > 1 splits every layer's heads and MLP over N processes (see
    kvlm.parallel): this one is rank 0 and starts the others.

    `device`: "cpu", "cuda" (an NVIDIA GPU: weights dense in bfloat16 there, the KV cells and states too; see
    kvlm.model.settings) or "auto" (CUDA where torch sees a GPU).

    `memory` is the memory the model will be asked for (n_ctx None: the largest that fits); `memory_budget`
    (bytes) caps weights + KV + buffers. A model that does not fit is refused before any weight is read
    (MemoryPlanError, naming each part); `Model.plan` says what was planned.
    """
    if compile and batch_invariant:
        raise ValueError("compile and batch_invariant exclude each other: compiled graphs sum in the order their "
                         "shapes suit, so a batch-invariant model runs eagerly")
    if compile and tensor_parallel_size != 1:
        raise ValueError("compile and tensor parallelism exclude each other: a compiled graph cannot stop at each "
                         "rank's all-reduce; a tensor-parallel model runs eagerly")
    if compile:
        check_compiler()
    settings = resolve_settings(dtype, quant, batch_invariant, compile=compile, device=device)
    source = resolve_model(spec, fetch=fetch, progress=progress)
    memory = memory or MemoryRequest()
    if tensor_parallel_size != 1:
        return _load_tensor_parallel(source, settings, tensor_parallel_size, memory, memory_budget, progress)
    model = load_rank(str(source), 0, 1, settings, memory, memory_budget, progress)
    if compile:
        model.graphs = StepGraphs(model.decoder)
    return model


def open_model(source: Path) -> tuple[ModelConfig, ModelWeights, Any]:
    """The config, the (unread) weights, and what the tokenizer is built from, of a GGUF file or a folder."""
    if source.is_dir():
        config, weights = open_hf_folder(source)
        return config, weights, source
    return open_gguf_model(source)


def load_rank(spec: str, rank: int = 0, size: int = 1, settings: ComputeSettings | None = None,
              memory: MemoryRequest | None = None, budget: int | None = None, progress: bool = False,
              planned: bool = False) -> Model:
    """The model, or (size > 1) rank `rank`'s shard of it, read one tensor at a time.

    A process of its own plans its memory first; the ranks of a tensor-parallel group were planned for by rank 0
    (`planned`). Only rank 0 builds the tokenizer.
    """
    settings = settings or resolve_settings()
    source = resolve_model(spec, progress=False)
    config, weights, tokenizer_source = open_model(source)
    if size > 1:
        weights.shard = make_shard(config, {n: weights.file_type(n) for n in weights.names()}, rank, size)
        weights.config = config = weights.shard.config
    plan = None if planned else plan_memory(config, weights, settings, memory or MemoryRequest(), budget,
                                            native_kernels() is not None, where=source.name)
    # Rank 0's tokenizer is built beside the weights: Python work, which runs while the loading thread waits on
    # the kernel (reads, fresh pages) and on the native rearrangement, both outside the GIL (-0.5 s of a 7B's start).
    with ThreadPoolExecutor(1, thread_name_prefix="kvlm-tokenizer") as pool:
        tokenizer = pool.submit(_tokenizer, tokenizer_source) if rank == 0 else None
        weights.tiles = _tile_cache(source, weights, settings, rank, size)
        with _progress_bar(source, weights, settings, plan, progress) as bar:
            weights.on_read = lambda name, nbytes: bar.update(nbytes)
            decoder = Decoder(config, weights, settings)
        weights.source.close()
        saving = weights.tiles.save() if weights.tiles is not None else 0
        if saving and rank > 0:  # a tensor-parallel worker: rank 0 ends it soon after a stop, so it writes them now
            weights.tiles.saved.result()
        if saving and progress:
            print(f"kvlm: writing this model's tiles ({saving / 2**20:.0f} MiB) to {weights.tiles.path} in the "
                  f"background for faster starts; a command that ends first waits for it ({TILES_VARIABLE}=0 for none)",
                  file=sys.stderr, flush=True)
        if tokenizer is None:
            return Model(config, decoder, None, source)
        return Model(config, decoder, tokenizer.result(), source, plan)


def _tile_cache(source: Path, weights: ModelWeights, settings: ComputeSettings, rank: int,
                size: int) -> TileCache | None:
    """Where a load that keeps the file's blocks for the native products in tiles finds them from an earlier one."""
    kernels = native_kernels()
    if settings.quant != FROM_FILE or settings.device != "cpu" or kernels is None or not kernels.tiles:
        return None
    files = weights.source.files + ([source / "config.json"] if source.is_dir() else [])
    return tile_cache_for(files, kernels.path.parent.name, (rank, size))


def _tokenizer(source: Path | dict[str, Any]) -> Tokenizer:
    """The tokenizer of a Hugging Face folder, or of a GGUF file's metadata."""
    return Tokenizer.from_hf_folder(source) if isinstance(source, Path) else Tokenizer.from_gguf_metadata(source)


def _progress_bar(source: Path, weights: ModelWeights, settings: ComputeSettings, plan: MemoryPlan | None,
                  show: bool) -> tqdm:
    """A bar over the file's bytes as its tensors are read, after a line saying what is being done."""
    total = sum(weights.entry(name).nbytes for name in weights.names())
    if show:
        memory = "" if plan is None else f"; planned {plan.total / 2**20:.0f} MiB with the KV cache"
        print(f"kvlm: loading {source.name} ({total / 2**20:.0f} MiB): {settings.dtype} activations, weights "
              f"{'as the file stores them' if settings.quant == 'file' else settings.quant or 'dense'}{memory}",
              file=sys.stderr, flush=True)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=source.name, disable=not show,
                leave=False)


def _load_tensor_parallel(source: Path, settings: ComputeSettings, size: int, memory: MemoryRequest,
                          budget: int | None, progress: bool) -> Model:
    """Rank 0 plans for the whole group on this host (each rank's shard, and its share of the KV cache), then
    every rank loads its shard."""
    from kvlm.parallel.launch import (
        launch_tensor_parallel,  # torch.distributed loads only for this
    )

    config, weights, _ = open_model(source)
    check_tensor_parallel(config, size)  # before any weight is read
    weights.shard = make_shard(config, {n: weights.file_type(n) for n in weights.names()}, 0, size)
    held = weight_bytes(weights.shard.config, weights, settings, native_kernels() is not None)
    plan = fit(weights.shard.config, held, settings, memory, budget, where=source.name, ranks=size)
    weights.source.close()
    load = functools.partial(load_rank, str(source), size=size, settings=settings, planned=True)
    model = launch_tensor_parallel(size, functools.partial(_rank, load, progress), settings.device)
    model.plan = plan
    return model


def _rank(load, progress: bool, rank: int) -> Model:
    return load(rank=rank, progress=progress and rank == 0)


def plan_for_loaded(model: Model, request: MemoryRequest, budget: int | None = None) -> MemoryPlan:
    """The plan of a loaded model's memory (its weights as they are held), refused (MemoryPlanError) if it does not
    fit, before anything is allocated."""
    ranks = model.tensor_parallel.size if model.tensor_parallel is not None else 1
    return fit(model.config, model.decoder.nbytes, model.decoder.settings, request, budget, where=model.source.name,
               ranks=ranks, loaded=True)


def load_summary(spec: str = DEFAULT_MODEL, *, fetch: bool = True,
                 progress: bool = True) -> tuple[ModelConfig, dict[str, str]]:
    """The config and how the file stores each tensor (GGUF type names; empty for a Hugging Face folder)."""
    source = resolve_model(spec, fetch=fetch, progress=progress)
    return (config_from_hf(source), {}) if source.is_dir() else read_gguf_summary(source)
