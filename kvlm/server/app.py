"""The OpenAI-compatible HTTP API over one engine: FastAPI routes, streaming as Server-Sent Events."""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from kvlm.engine.engine import Engine
from kvlm.engine.request import RequestOutput
from kvlm.server.async_engine import EngineFailure, Finished
from kvlm.server.errors import error_body, install_error_handlers
from kvlm.server.kv_report import kv_report
from kvlm.server.embeddings_api import add_embeddings_routes
from kvlm.server.messages_api import add_messages_routes
from kvlm.server.responses_api import add_responses_routes
from kvlm.server.served import Choice, ServedModel
from kvlm.server.transport import CLIENT_CLOSED_REQUEST, sse, until_disconnected
from kvlm.tool_calls.chat_output import ChatOutputSpec, ChoiceStream
from kvlm.server.chat_turn import chat_prompt, compiled, constraint_field
from kvlm.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    checked_max_tokens,
)
from kvlm.server.responses import LogprobsFormatter, Reply, usage

def create_app(engine: Engine, model_name: str, api_key: str | None = None, pooling: str | None = None) -> FastAPI:
    served = ServedModel(engine, model_name, pooling)
    runner, metrics, tokenizer = served.runner, served.metrics, served.tokenizer

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        runner.start()
        yield
        await asyncio.to_thread(runner.stop)

    app = FastAPI(title="kvlm", lifespan=lifespan)
    app.state.runner = runner
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

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise BadRequest(f"The model '{name}' does not exist; this server serves '{model_name}'", "model",
                             status=404, code="model_not_found")

    def served_for(name: str | None) -> ServedModel:
        check_model(name)
        return served

    app.state.responses = add_responses_routes(app, served_for, authorized)
    add_messages_routes(app, served_for, authorized)
    add_embeddings_routes(app, served_for, authorized)

    # --- generation ---
    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        body.check_supported()
        prompts = [served.token_ids(p, "prompt") for p in body.prompts()]
        constraint = body.constraint()
        await compiled(engine.grammars, constraint, constraint_field(body))
        n, choices, priority = body.n_choices(), [], served.priority_checked(body.priority)
        for p, ids in enumerate(prompts):
            max_tokens = checked_max_tokens(body.max_tokens, len(ids), engine.n_ctx, "max_tokens")
            choices += [Choice(p * n + i, ids, served.sampling_checked(body.sampling_params(max_tokens, body.logprobs,
                                                                                            i, constraint)),
                               priority=priority)
                        for i in range(n)]
        reply = Reply("text_completion", model_name)
        return await respond(reply, body, choices, sum(map(len, prompts)), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        turn = await served.chat_turn(body)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        choices = served.chat_choices(body, turn, field)
        ids = turn.prompt_token_ids
        reply = Reply("chat.completion", model_name)
        return await respond(reply, body, choices, len(ids), request, turn.output)

    async def respond(reply: Reply, body, choices: list[Choice], n_prompt: int, request: Request,
                      output_spec: ChatOutputSpec | None = None) -> Response:
        formatter = LogprobsFormatter(tokenizer, reply.chat)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream_events(reply, choices, formatter, n_prompt, include_usage, output_spec),
                                     media_type="text/event-stream")
        outputs = await until_disconnected(request, asyncio.gather(*(run_choice(reply, c) for c in choices)))
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
        for output in outputs:
            if output.error:
                raise BadRequest(output.error, "prompt")
        return JSONResponse(reply.body(
            [reply.choice(c.index, o.text, formatter.format(o.logprobs or []), o.finish_reason, output_spec)
             for c, o in zip(choices, outputs)],
            usage(n_prompt, sum(len(o.token_ids) for o in outputs), max(o.n_cached_tokens for o in outputs))))

    async def run_choice(reply: Reply, choice: Choice) -> RequestOutput:
        return await served.run(f"{reply.id}-{choice.index}", choice)

    async def stream_events(reply: Reply, choices: list[Choice], formatter: LogprobsFormatter, n_prompt: int,
                            include_usage: bool, output_spec: ChatOutputSpec | None) -> AsyncIterator[str]:
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for item in served.events(f"{reply.id}-{choice.index}", choice):
                    await merged.put((choice.index, item))
            except EngineFailure as exc:
                await merged.put((choice.index, exc))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        offsets = {c.index: 0 for c in choices}
        readers = {c.index: ChoiceStream(output_spec) for c in choices}
        n_generated, n_cached, n_open = 0, 0, len(choices)
        try:
            while n_open:
                index, item = await merged.get()
                if isinstance(item, EngineFailure):
                    yield sse(error_body(str(item), 500))
                    break
                reader = readers[index]
                if isinstance(item, Finished):
                    n_open -= 1
                    n_generated += len(item.output.token_ids)
                    n_cached = max(n_cached, item.output.n_cached_tokens)
                    for delta in reader.last_deltas():
                        yield sse(reply.chunk([reply.delta(index, delta, None, None)]))
                    finish_reason = reader.finish_reason(item.output.finish_reason)
                    yield sse(reply.chunk([reply.delta(index, {}, None, finish_reason)]))
                    continue
                logprobs = formatter.format(item.new_logprobs or [], offsets[index])
                offsets[index] = formatter.next_offset(logprobs, offsets[index])
                for delta in reader.deltas(item.new_text, logprobs is not None):
                    yield sse(reply.chunk([reply.delta(index, delta, logprobs, None)]))
                    logprobs = None
            if include_usage:
                yield sse(reply.chunk([], usage(n_prompt, n_generated, n_cached)))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()  # a client that left: its requests are aborted and their cells freed

    # --- tokens ---
    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = tokenizer.encode(chat_prompt(tokenizer, body), add_special_tokens=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.n_ctx}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        return {"prompt": tokenizer.decode(served.token_ids(body.tokens, "tokens"))}

    # --- about the server ---
    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvlm",
                                            "max_model_len": engine.n_ctx}]}

    @app.get("/health")
    async def health() -> Response:
        if not runner.running:
            return JSONResponse(error_body("the engine is not running", 503), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        await runner.call(metrics.refresh)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv")
    async def kv() -> dict:
        return await runner.call(kv_report)

    @app.get("/kv/view")
    async def kv_view() -> HTMLResponse:
        return HTMLResponse(resources.files("kvlm.server").joinpath("kv_view.html").read_text(encoding="utf-8"))

    return app
