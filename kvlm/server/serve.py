"""`kvlm serve`: load the model (or models: kvlm.server.model_set), build the engines and the app, and run uvicorn
until SIGINT or SIGTERM."""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from kvlm.engine.engine import DEFAULT_DISK_TIER, Engine, memory_request
from kvlm.loader.gguf_split import split_prefix
from kvlm.loader.load import load_model
from kvlm.memory.kv_store import AUTO
from kvlm.memory.recurrent import BANKS
from kvlm.server.app import create_app
from kvlm.server.kv_report import recurrent_part
from kvlm.server.model_set import ModelSet
from kvlm.speculative.config import SpeculativeConfig
from kvlm.startup import in_passing_thread

log = logging.getLogger("kvlm")


@dataclass
class ServeSettings:
    model: str | list[str]  # one model, or several served side by side
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = AUTO
    quant: str | None = AUTO
    device: str = AUTO  # cpu, cuda, or auto (cuda where torch sees a GPU)
    batch_invariant: bool = False
    compile: bool = False  # compiled decode and prefill graphs (kvlm.model.graphs)
    n_ctx: int | None = None  # None: the largest that fits in memory, up to the model's own
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_dtype: str = AUTO  # bf16 for a bfloat16 model; f16 (quantized weights) or f32 (dense) for a float32 one
    swa_full: bool = False  # keep every cell of sliding-window layers (one unified pool, llama.cpp's --swa-full)
    api_key: str | None = None
    served_model_name: str | list[str] | None = None  # one per model, in order
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGINT/SIGTERM
    tensor_parallel_size: int = 1  # processes the model's heads and MLP are split over (kvlm.parallel)
    memory_budget: int | None = None  # bytes for weights, KV cache and buffers (None: the machine's)
    speculative_config: SpeculativeConfig | None = None  # vLLM's (kvlm.speculative.config)
    enforce_eager: bool = False  # no CUDA graphs for decode steps on a GPU (vLLM's)
    prefix_cache_ram: int = 0  # bytes of finished sequences' states kept in RAM (kvlm.engine.prefix_tiers)
    prefix_cache_dir: str | None = None  # and on disk, across restarts
    prefix_cache_disk: int = DEFAULT_DISK_TIER
    pooling: str | None = None  # embeddings: last, mean or cls (None: each model's own)
    scheduling_policy: str = "fcfs"  # or "priority" (vLLM's)
    # several models: load all at start (one model always is), unload after that many idle seconds, keep at most
    # that many loaded
    preload: bool = False
    idle_unload: float | None = None
    max_loaded_models: int | None = None

    def named_models(self) -> list[tuple[str, str]]:
        """(served name, source) of each model; ValueError when the names given do not match the models."""
        sources = [self.model] if isinstance(self.model, str) else list(self.model)
        names = self.served_model_name
        names = [None] * len(sources) if names is None else [names] if isinstance(names, str) else list(names)
        if len(names) != len(sources):
            raise ValueError(f"--served-model-name was given {len(names)} times for {len(sources)} models: give it "
                             "once per --model, in the same order")
        return [(name or served_name(source), source) for name, source in zip(names, sources)]


def served_name(model: str) -> str:
    """What clients put in "model": the known name as given, or a file's or folder's name."""
    path = Path(model)
    if path.suffix == ".gguf":
        return split_prefix(path) or path.stem  # (a split model by its name, not its part's)
    return path.name if path.exists() else model


def _kind(memory) -> str:
    return f" ({memory.kind})" if len(memory.pools) > 1 or memory.kind == "hybrid" else ""


def _pools(memory) -> str:
    """'1024 cells x 30 layers' for one pool; each pool by name, with its window, for several."""
    def one(pool) -> str:
        layers = f"{pool.n_cells} cells x {pool.store.n_layer} layer{'' if pool.store.n_layer == 1 else 's'}"
        return layers if len(memory.pools) == 1 else (
            f"{pool.name} pool {layers}" + (f" (window {pool.window})" if pool.window else ""))

    return ", ".join(one(pool) for pool in memory.pools)


def _recurrent_state(memory) -> str | None:
    """'recurrent state: 33 slots x 2 banks x 31488 bytes (3 layers, float32): 2078208 bytes (2.0 MiB)' for a memory
    with recurrent layers (one state slot per sequence id, each the same size, in two banks: the committed state and
    the one a batch writes); None for the KV-only kinds."""
    slots = recurrent_part(memory)
    if slots is None:
        return None
    n_layer, per_bank = slots.n_layer, slots.kv_bytes // (slots.n_seq_max * BANKS)
    dtypes = sorted({str(s.dtype).removeprefix("torch.") for layer in slots.banks for s in layer})
    return (f"recurrent state: {slots.n_seq_max} slots x {BANKS} banks x {per_bank} bytes ({n_layer} "
            f"layer{'' if n_layer == 1 else 's'}, {'/'.join(dtypes)}): {slots.kv_bytes} bytes "
            f"({slots.kv_bytes / 2**20:.1f} MiB)")


def _tier(tier) -> str:
    """'disk /x/<fingerprint>: 3 entries, 1.2 of 10240.0 MiB' (what a previous process left there, for disk)."""
    where = f" {tier.folder}" if hasattr(tier, "folder") else ""
    return (f"{tier.name}{where}: {len(tier.entries)} entries, {tier.n_bytes / 2**20:.1f} of "
            f"{tier.capacity / 2**20:.1f} MiB")


def _log_memory(memory, kv_dtype: str, max_num_seqs: int) -> None:
    """The KV cache's pools and bytes (as they always were for the KV-only kinds), then the recurrent state's."""
    slots, state = recurrent_part(memory), _recurrent_state(memory)
    if memory.pools:
        kv_bytes = memory.kv_bytes - (slots.kv_bytes if slots is not None else 0)  # the KV pools' bytes alone
        log.info("KV cache%s: %s, %s: %d bytes (%.1f MiB); up to %d sequences", _kind(memory), _pools(memory),
                 kv_dtype, kv_bytes, kv_bytes / 2**20, max_num_seqs)
    else:
        log.info("no KV cache (%s memory: no attention layers); up to %d sequences", memory.kind, max_num_seqs)
    if state:
        log.info("%s", state)


def serve(settings: ServeSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    speculative = settings.speculative_config
    request = memory_request(settings.n_ctx, settings.max_num_seqs, settings.max_num_batched_tokens, settings.kv_dtype,
                             swa_full=settings.swa_full,
                             speculative_tokens=speculative.num_speculative_tokens if speculative else 0)
    named = settings.named_models()
    if settings.tensor_parallel_size != 1 and (len(named) > 1 or settings.idle_unload or settings.max_loaded_models):
        raise ValueError("tensor parallelism serves one model, loaded for the server's life: give one --model, "
                         "without --idle-unload or --max-loaded-models")

    def build(name: str, source: str, budget: int | None) -> Engine:
        model = load_model(source, settings.dtype, quant=settings.quant,
                           batch_invariant=settings.batch_invariant, compile=settings.compile,
                           tensor_parallel_size=settings.tensor_parallel_size, memory=request,
                           memory_budget=budget, device=settings.device)
        engine = Engine(model, n_ctx=settings.n_ctx or model.plan.n_ctx, max_num_seqs=settings.max_num_seqs,
                        max_num_batched_tokens=settings.max_num_batched_tokens, kv_dtype=settings.kv_dtype,
                        swa_full=settings.swa_full, memory_budget=budget,
                        speculative_config=speculative, enforce_eager=settings.enforce_eager,
                        prefix_cache_ram=settings.prefix_cache_ram, prefix_cache_dir=settings.prefix_cache_dir,
                        prefix_cache_disk=settings.prefix_cache_disk, scheduling_policy=settings.scheduling_policy)
        _log_setup(engine, name, speculative)
        return engine

    # The engine steps on a thread of its own (kvlm.server.async_engine): no other thread may keep OpenMP workers.
    # (Tensor parallelism pins this thread to rank 0's cores, which the engine thread inherits: it builds here.)
    def built(name: str, source: str, budget: int | None) -> Engine:
        return in_passing_thread(lambda: build(name, source, budget)) if settings.tensor_parallel_size == 1 else \
            build(name, source, budget)

    models = ModelSet(named, built, settings.pooling, settings.max_loaded_models, settings.memory_budget,
                      settings.idle_unload)
    for name in models.preloaded if len(named) == 1 or settings.preload else ():
        models.load_now(name)
    log.info("serving %s", ", ".join(f"{entry.name} ({entry.state})" for entry in models.entries.values()))
    app = create_app(models, api_key=settings.api_key)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=settings.shutdown_timeout)
    server = uvicorn.Server(config)
    log.info("serving at http://%s:%d/v1 (KV view: http://%s:%d/kv/view)", settings.host, settings.port,
             settings.host, settings.port)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in place
    # the re-raised signal is only logged, and the process exits 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _: log.info("stopped by %s", signal.Signals(s).name))
    parallel = models.loaded[0].served.engine.model.tensor_parallel if models.loaded else None
    if parallel is not None:  # a rank that dies or hangs stops the server: it cannot compute again
        parallel.on_failure.append(lambda _: setattr(server, "should_exit", True))
    server.run()
    if parallel is not None:
        failure = parallel.failure
        parallel.stop()
        if failure is not None:
            log.error("the server stopped: %s", failure)
            return 1
    return 0


def _log_setup(engine: Engine, name: str, speculative: SpeculativeConfig | None) -> None:
    model, memory = engine.model, engine.context.memory
    log.info("model %s (%s) from %s", name, model.config.architecture, model.source)
    log.info("compute: %s", model.decoder.describe())
    log.info("memory: %s", "; ".join(f"{label} {text}" for label, text in engine.plan.lines()))
    _log_memory(memory, engine.context.kv_dtype, engine.scheduler.max_num_seqs)
    if engine.tiers is not None:
        log.info("prefix cache tiers: %s", "; ".join(_tier(tier) for tier in engine.tiers.tiers) or "none")
    if speculative is not None:
        log.info("speculative decoding: %s, up to %d guessed tokens per step%s", speculative.method,
                 speculative.num_speculative_tokens, ", as many as pay (measured)" if speculative.adaptive else "")
