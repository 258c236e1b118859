"""The models one server serves (`kvlm serve --model A --model B`), each under its name, loaded when first asked
for (or at start) and unloaded when idle or when another needs the room, as llama-swap does in front of llama.cpp.

- A request names its model; an unknown name is a 404 that lists the served ones.
- Loading runs off the event loop, one model at a time; requests for that model wait for it.
- `max_loaded`: at most that many loaded at once; loading another unloads the least recently used idle one.
- `memory_budget` (bytes) is the whole server's: each model is planned in what the loaded ones leave. Without
  one, the machine's memory (what this process already holds counted as used). A model that does not fit
  unloads idle ones, least recently used first, until it does; when none is left to unload it is refused (503),
  the plan's sizes named.
- `idle_unload` (seconds): a model with no request in flight for that long is unloaded.

A model is idle when its engine has no request in flight and it was neither asked for nor ended a request in the
last IDLE_GRACE_S seconds (a request between choosing its model and reaching the engine); its idle time counts from
the later of the two. `preload` loads the first `max_loaded` models (all without that bound).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvlm.core.errors import KvlmError
from kvlm.engine.engine import Engine
from kvlm.loader.memory_plan import MemoryPlanError
from kvlm.server.protocol import BadRequest
from kvlm.server.served import ServedModel

log = logging.getLogger("kvlm")

IDLE_GRACE_S = 2.0
LOADED, UNLOADED, LOADING = "loaded", "unloaded", "loading"


@dataclass
class ModelEntry:
    name: str
    source: str  # what --model gave: a known name, a path, a Hub repository
    served: ServedModel | None = None
    loading: bool = False
    last_used: float = 0.0

    @property
    def state(self) -> str:
        return LOADED if self.served is not None else LOADING if self.loading else UNLOADED

    @property
    def last_active(self) -> float:
        """When it was last asked for, or last ended a request, whichever is later (time.monotonic())."""
        return max(self.last_used, self.served.runner.last_finished if self.served is not None else 0.0)

    def idle(self, now: float) -> bool:
        return self.served is not None and not self.served.runner.busy and now - self.last_active >= IDLE_GRACE_S


class ModelSet:
    def __init__(self, models: list[tuple[str, str]], build: Callable[[str, str, int | None], Engine],
                 pooling: str | None = None, max_loaded: int | None = None, memory_budget: int | None = None,
                 idle_unload: float | None = None) -> None:
        """`models`: (name, source) pairs; `build(name, source, budget)`: the engine of a model, planned within
        `budget` bytes (None: the machine's memory). Names must differ."""
        names = [name for name, _ in models]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise ValueError(f"two models are served as {duplicate!r}: give each its own --served-model-name")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded_models must be at least 1, got {max_loaded}")
        if idle_unload is not None and idle_unload <= 0:
            raise ValueError(f"idle_unload must be a positive number of seconds, got {idle_unload}")
        self.entries = {name: ModelEntry(name, source) for name, source in models}
        self._build, self.pooling = build, pooling
        self.max_loaded, self.memory_budget, self.idle_unload = max_loaded, memory_budget, idle_unload
        self._lock = asyncio.Lock()

    @classmethod
    def of(cls, engine: Engine, name: str, pooling: str | None = None) -> ModelSet:
        """One model, loaded already (nothing to build or unload)."""
        models = cls([(name, name)], lambda *args: engine, pooling)
        models.entries[name].served = ServedModel(engine, name, pooling)
        return models

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    @property
    def loaded(self) -> list[ModelEntry]:
        return [entry for entry in self.entries.values() if entry.served is not None]

    def entry(self, name: str | None) -> ModelEntry:
        """The named model's entry; a request without a name gets the first model."""
        if name is None:
            return next(iter(self.entries.values()))
        if name not in self.entries:
            raise BadRequest(f"The model '{name}' does not exist; this server serves {', '.join(map(repr, self.names))}",
                             "model", status=404, code="model_not_found")
        return self.entries[name]

    async def get(self, name: str | None) -> ServedModel:
        """The named model, loaded if it is not."""
        entry = self.entry(name)
        entry.last_used = time.monotonic()
        if entry.served is None:
            async with self._lock:
                if entry.served is None:
                    await self._load(entry)
        entry.last_used = time.monotonic()
        return entry.served

    async def _load(self, entry: ModelEntry) -> None:
        entry.loading = True
        try:
            while self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
                if not await self._unload_one(f"to load {entry.name!r} (--max-loaded-models {self.max_loaded})"):
                    raise BadRequest(f"the model '{entry.name}' cannot be loaded now: {self.max_loaded} models are "
                                     f"loaded (--max-loaded-models) and each has requests in flight", "model",
                                     status=503)
            while True:
                try:
                    engine = await asyncio.to_thread(self._build, entry.name, entry.source, self._budget_left())
                    break
                except MemoryPlanError as exc:
                    if not await self._unload_one(f"to make room for {entry.name!r}"):
                        raise BadRequest(f"the model '{entry.name}' does not fit in memory beside the loaded ones "
                                         f"({', '.join(e.name for e in self.loaded) or 'none'}): {exc}", "model",
                                         status=503) from None
                except (KvlmError, OSError, ValueError) as exc:  # a file that is missing, unreadable or not a model
                    log.error("model %s could not be loaded: %s", entry.name, exc)
                    raise BadRequest(f"the model '{entry.name}' could not be loaded: {exc}", "model",
                                     status=503) from None
            served = ServedModel(engine, entry.name, self.pooling)
            served.runner.start()
            entry.served = served
            log.info("model %s loaded (%d of %d served models loaded)", entry.name, len(self.loaded), len(self.entries))
        finally:
            entry.loading = False

    def _budget_left(self) -> int | None:
        if self.memory_budget is None:
            return None
        left = self.memory_budget - sum(entry.served.engine.plan.total for entry in self.loaded)
        if left <= 0:
            raise MemoryPlanError(f"the loaded models take the whole memory budget ({self.memory_budget} bytes)")
        return left

    async def _unload_one(self, why: str) -> bool:
        """Unload the least recently used idle model; False when none is idle."""
        now = time.monotonic()
        idle = sorted((e for e in self.loaded if e.idle(now)), key=lambda e: e.last_active)
        if not idle:
            return False
        await self.unload(idle[0], why)
        return True

    async def unload(self, entry: ModelEntry, why: str) -> None:
        served, entry.served = entry.served, None
        await asyncio.to_thread(served.runner.stop)
        del served
        gc.collect()  # its weights and cache go back to the system now, not at some later collection
        log.info("model %s unloaded %s", entry.name, why)

    def load_now(self, name: str) -> None:
        """Load a model before the server runs (its engine thread starts with the server)."""
        entry = self.entries[name]
        entry.served = ServedModel(self._build(name, entry.source, self._budget_left()), name, self.pooling)

    @property
    def preloaded(self) -> list[str]:
        """What preloading loads: the first max_loaded models, or all of them."""
        return self.names[:self.max_loaded]

    async def preload(self) -> None:
        for name in self.preloaded:
            await self.get(name)

    async def unload_idle(self) -> None:
        """Unload every model idle for idle_unload seconds."""
        now = time.monotonic()
        for entry in self.loaded:
            if entry.idle(now) and now - entry.last_active >= self.idle_unload:
                async with self._lock:
                    if entry.idle(time.monotonic()):
                        await self.unload(entry, f"after {self.idle_unload:g} s idle (--idle-unload)")

    async def watch_idle(self) -> None:
        """Run unload_idle while the server runs (with idle_unload set)."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_unload / 4))
            await self.unload_idle()

    def stop(self) -> None:
        for entry in self.loaded:
            entry.served.runner.stop()

    def describe(self) -> list[dict]:
        """/v1/models' entries: each model with its state (and its context length while loaded)."""
        out = []
        for entry in self.entries.values():
            item = {"id": entry.name, "object": "model", "created": 0, "owned_by": "kvlm", "status": entry.state}
            if entry.served is not None:
                item["max_model_len"] = entry.served.engine.n_ctx
            out.append(item)
        return out
