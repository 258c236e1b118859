"""OpenAI's text completions and chat completions (whole, or streamed as chunks), and vLLM's tokenize and
detokenize."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvlm.server.async_engine import EngineFailure, Finished
from kvlm.server.chat_turn import chat_prompt, compiled, constraint_field
from kvlm.server.errors import error_body
from kvlm.server.model_set import ModelSet
from kvlm.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    checked_max_tokens,
)
from kvlm.server.responses import LogprobsFormatter, Reply, usage
from kvlm.server.served import Choice, ServedModel
from kvlm.server.transport import CLIENT_CLOSED_REQUEST, sse, until_disconnected
from kvlm.tool_calls.chat_output import ChatOutputSpec, ChoiceStream


def add_chat_routes(app: FastAPI, models: ModelSet, authorized: Callable) -> None:
    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served = await models.get(body.model)
        engine = served.engine
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
        reply = Reply("text_completion", served.name)
        return await respond(served, reply, body, choices, sum(map(len, prompts)), request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        served = await models.get(body.model)
        turn = await served.chat_turn(body)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        choices = served.chat_choices(body, turn, field)
        ids = turn.prompt_token_ids
        reply = Reply("chat.completion", served.name)
        return await respond(served, reply, body, choices, len(ids), request, turn.output)

    async def respond(served: ServedModel, reply: Reply, body, choices: list[Choice], n_prompt: int,
                      request: Request, output_spec: ChatOutputSpec | None = None) -> Response:
        formatter = LogprobsFormatter(served.tokenizer, reply.chat)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream_events(served, reply, choices, formatter, n_prompt, include_usage,
                                                   output_spec), media_type="text/event-stream")
        outputs = await until_disconnected(
            request, asyncio.gather(*(served.run(f"{reply.id}-{c.index}", c) for c in choices)))
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is left to read it
        for output in outputs:
            if output.error:
                raise BadRequest(output.error, "prompt")
        return JSONResponse(reply.body(
            [reply.choice(c.index, o.text, formatter.format(o.logprobs or []), o.finish_reason, output_spec)
             for c, o in zip(choices, outputs)],
            usage(n_prompt, sum(len(o.token_ids) for o in outputs), max(o.n_cached_tokens for o in outputs))))

    async def stream_events(served: ServedModel, reply: Reply, choices: list[Choice], formatter: LogprobsFormatter,
                            n_prompt: int, include_usage: bool,
                            output_spec: ChatOutputSpec | None) -> AsyncIterator[str]:
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
        served = await models.get(body.model)
        tokenizer = served.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = tokenizer.encode(chat_prompt(tokenizer, body), add_special_tokens=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.engine.n_ctx}

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        served = await models.get(body.model)
        return {"prompt": served.tokenizer.decode(served.token_ids(body.tokens, "tokens"))}
