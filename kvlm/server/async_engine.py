"""The engine on a thread of its own, fed and read from asyncio.

The `Engine` is synchronous and not thread-safe, so one thread owns it: it takes commands (add, abort,
inspect) from a queue, runs engine steps while there is work, and hands each request's events to the
asyncio queue of the coroutine waiting on it. Web handlers never touch the engine directly.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvlm.engine.engine import Engine
from kvlm.engine.request import RequestOutput, StepEvent
from kvlm.sampling.params import SamplingParams

log = logging.getLogger("kvlm")

IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps between checks for commands


@dataclass
class Finished:
    """The last item of a request's stream: its whole output."""

    output: RequestOutput


class EngineFailure(RuntimeError):
    """The engine thread could not run a step; every request in flight gets this."""


class StepObserver:
    """Told what the engine did; the metrics implement it. The defaults do nothing."""

    def on_step(self, engine: Engine, events: list[StepEvent], now: float) -> None: ...

    def on_finished(self, output: RequestOutput) -> None: ...


class AsyncEngine:
    def __init__(self, engine: Engine, observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer or StepObserver()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = threading.Event()
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}  # see _flush
        self._thread = threading.Thread(target=self._run, name="kvlm-engine", daemon=True)
        self._last_finished = 0.0

    # --- lifecycle ---
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Abort whatever is still in flight and end the engine thread."""
        self._stopping.set()
        self._commands.put(lambda: None)  # wake the thread
        self._thread.join()

    @property
    def busy(self) -> bool:
        """Whether a request is in flight (added, and not yet finished or aborted)."""
        return bool(self._streams)

    @property
    def last_finished(self) -> float:
        """time.monotonic() when the last request in flight ended (0 before any)."""
        return self._last_finished

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def _check_running(self) -> None:
        if not self.running:
            raise EngineFailure("the engine is not running")

    # --- what handlers call ---
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       reasoning_ended: Callable[[str], int | None] | None = None, pooling: str | None = None,
                       priority: int = 0) -> AsyncIterator[StepEvent | Finished]:
        """The request's events as they come, then `Finished`. Leaving early (a disconnect) aborts it. `pooling`
        and `priority`: as Engine.add_request takes them."""
        self._check_running()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, events)
        self._commands.put(lambda: self._add(request_id, prompt_token_ids, params, reasoning_ended, pooling,
                                             priority))
        finished = False
        try:
            while True:
                item = await events.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, Finished):
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(lambda: self._abort(request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread, between steps, and return its result."""
        self._check_running()
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(run)
        return await future

    # --- the engine thread ---
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished() and not self._stopping.is_set():
                    self._step()
                self._flush()
        except BaseException:
            log.exception("the engine thread failed")
            raise
        finally:
            self._stopping.set()
            self._drain_commands(block=False)  # requests still queued are refused, inspections answered
            for request_id in list(self._streams):
                if request_id in self.engine.requests:
                    self._abort(request_id)
                else:
                    self._fail(request_id, EngineFailure("the engine stopped before the request started"))
            self._flush()

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:  # noqa: BLE001 - one bad command must not end the thread every request waits on
                log.exception("an engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
            log.exception("engine step failed")
            for request_id in [r for r in self._streams if r in self.engine.requests]:
                self._fail(request_id, EngineFailure(f"the engine failed: {type(exc).__name__}: {exc}"))
            return
        self.observer.on_step(self.engine, events, time.perf_counter())
        for event in events:
            self._send(event.request_id, event)
            if event.finished:
                self._finish(event.request_id)

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             reasoning_ended: Callable[[str], int | None] | None, pooling: str | None, priority: int) -> None:
        if request_id not in self._streams:  # the client left before its request reached the engine
            return
        if self._stopping.is_set():
            self._fail(request_id, EngineFailure("the server is shutting down"))
            return
        try:
            self.engine.add_request(prompt_token_ids, params, request_id, reasoning_ended, pooling, priority)
        except Exception as exc:  # noqa: BLE001 - reported to its client
            self._fail(request_id, EngineFailure(f"the request could not start: {type(exc).__name__}: {exc}"))
            return
        if self.engine.requests[request_id].finished:  # refused (e.g. too long): no step will report it
            self._finish(request_id)

    def _abort(self, request_id: str) -> None:
        if request_id in self.engine.requests:
            self.engine.abort(request_id)
            self._finish(request_id)
        self._forget(request_id)

    def _finish(self, request_id: str) -> None:
        output = self.engine.release(request_id)
        self.observer.on_finished(output)
        self._send(request_id, Finished(output))
        self._forget(request_id)

    def _fail(self, request_id: str, error: Exception) -> None:
        if request_id in self.engine.requests:
            self.engine.abort(request_id)
            output = self.engine.release(request_id)
            output.finish_reason = "error"
            self.observer.on_finished(output)
        self._send(request_id, error)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """The request is no longer in flight."""
        self._streams.pop(request_id, None)
        self._last_finished = time.monotonic()

    def _send(self, request_id: str, item: object) -> None:
        """Queue an item for its request's stream; `_flush` hands them over."""
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, events = stream
            self._outbox.setdefault(loop, []).append((events, item))

    def _flush(self) -> None:
        """What a step (or a round of commands) produced, handed to each event loop in one call: one wake-up of the
        loop per step rather than one per token, so its thread takes the interpreter (and a core) from the engine
        thread once per step (at 8 streams one call per token made the served step 2-3x slower)."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop has closed: its clients are gone
                pass


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for events, item in items:
        events.put_nowait(item)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
