"""The HTTP server: OpenAI's APIs (completions, chat, Responses, embeddings), Anthropic's Messages API, and what
tells about the server (models, health, metrics, the KV cache), over one model or several (kvlm.server.model_set).

Every route names its model in the request body (`model`); a request without one gets the first served model.
"""
from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager, suppress
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from kvlm.engine.engine import Engine
from kvlm.server.chat_api import add_chat_routes
from kvlm.server.embeddings_api import add_embeddings_routes
from kvlm.server.errors import error_body, install_error_handlers
from kvlm.server.kv_report import kv_report
from kvlm.server.messages_api import add_messages_routes
from kvlm.server.model_set import ModelSet
from kvlm.server.protocol import BadRequest
from kvlm.server.responses_api import add_responses_routes


def create_app(models: ModelSet | Engine, model_name: str | None = None, api_key: str | None = None,
               pooling: str | None = None, preload: bool = False) -> FastAPI:
    """`models`: the served models, or one engine served as `model_name` (its embeddings pooled as `pooling`
    says, the model's own way by default). `preload`: load every model at start rather than at its first
    request."""
    if isinstance(models, Engine):
        models = ModelSet.of(models, model_name, pooling)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        for entry in models.loaded:
            entry.served.runner.start()
        if preload:
            await models.preload()
        watcher = asyncio.create_task(models.watch_idle()) if models.idle_unload else None
        yield
        if watcher is not None:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher
        await asyncio.to_thread(models.stop)

    app = FastAPI(title="kvlm", lifespan=lifespan)
    app.state.models = models
    install_error_handlers(app)

    async def authorized(request: Request) -> None:
        """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key)."""
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise BadRequest("Incorrect API key provided: pass it as 'Authorization: Bearer <key>' or "
                             "'x-api-key: <key>'", status=401, code="invalid_api_key")

    add_chat_routes(app, models, authorized)
    app.state.responses = add_responses_routes(app, models, authorized)
    add_messages_routes(app, models, authorized)
    add_embeddings_routes(app, models, authorized)

    # --- about the server ---
    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def list_models() -> dict:
        return {"object": "list", "data": models.describe()}

    @app.get("/health")
    async def health() -> Response:
        stopped = [entry.name for entry in models.loaded if not entry.served.runner.running]
        if stopped:
            return JSONResponse(error_body(f"the engine of {', '.join(stopped)} is not running", 503),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics(model: str | None = None) -> Response:
        """The named (or first) model's metrics; none while it is not loaded."""
        served = models.entry(model).served
        if served is None:
            return Response("", media_type="text/plain; version=0.0.4; charset=utf-8")
        await served.runner.call(served.metrics.refresh)
        return Response(served.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv")
    async def kv(model: str | None = None) -> dict:
        """The named (or first) model's KV cache, while it is loaded (this open route loads nothing)."""
        entry = models.entry(model)
        if entry.served is None:
            raise BadRequest(f"the model '{entry.name}' is not loaded: it has no KV cache now", "model", status=409)
        return await entry.served.runner.call(kv_report)

    @app.get("/kv/view")
    async def kv_view() -> HTMLResponse:
        return HTMLResponse(resources.files("kvlm.server").joinpath("kv_view.html").read_text(encoding="utf-8"))

    return app
