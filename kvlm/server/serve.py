"""`kvlm serve`: load the model, build the engine and the app, and run uvicorn until SIGINT or SIGTERM."""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from kvlm.engine.engine import Engine
from kvlm.load import load_model
from kvlm.memory.kv_store import AUTO
from kvlm.server.app import create_app

log = logging.getLogger("kvlm")


@dataclass
class ServeSettings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = AUTO
    quant: str | None = AUTO
    batch_invariant: bool = False
    compile: bool = False  # compiled decode and prefill graphs (kvlm.model.graphs)
    n_ctx: int = 8192
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_dtype: str = AUTO  # the model's dtype
    api_key: str | None = None
    served_model_name: str | None = None
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGINT/SIGTERM


def served_name(model: str) -> str:
    """What clients put in "model": the known name as given, or a file's or folder's name."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else model


def serve(settings: ServeSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = load_model(settings.model, settings.dtype, quant=settings.quant, batch_invariant=settings.batch_invariant,
                       compile=settings.compile)
    engine = Engine(model, n_ctx=settings.n_ctx, max_num_seqs=settings.max_num_seqs,
                    max_num_batched_tokens=settings.max_num_batched_tokens, kv_dtype=settings.kv_dtype)
    name = settings.served_model_name or served_name(settings.model)
    kv_bytes = engine.context.memory.kv_bytes
    log.info("model %s (%s) from %s", name, model.config.architecture, model.source)
    log.info("compute: %s", model.decoder.describe())
    log.info("KV cache: %d cells x %d layers, %s: %d bytes (%.1f MiB); up to %d sequences", settings.n_ctx,
             model.config.n_layer, engine.context.kv_dtype, kv_bytes, kv_bytes / 2**20, settings.max_num_seqs)
    app = create_app(engine, name, settings.api_key)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=settings.shutdown_timeout)
    server = uvicorn.Server(config)
    log.info("serving %s at http://%s:%d/v1 (KV view: http://%s:%d/kv/view)", name, settings.host, settings.port,
             settings.host, settings.port)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in place
    # the re-raised signal is only logged, and the process exits 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _: log.info("stopped by %s", signal.Signals(s).name))
    server.run()
    return 0
