"""Anthropic's Messages API: `POST /v1/messages` (whole, or streamed as Anthropic's events) and
`POST /v1/messages/count_tokens`. Errors on these paths have Anthropic's shape (kvlm.server.errors).

A message runs as one chat turn (messages_protocol); its output blocks (output_blocks) become content blocks:
`thinking`, `text` and one `tool_use` per call. stop_reason: "max_tokens" when max_tokens cut it, "tool_use" after
calls, "stop_sequence" (with the sequence) when one of stop_sequences ended it, else "end_turn". Usage counts the
prompt tokens the prefix cache served as cache_read_input_tokens (input_tokens are the rest, as Anthropic's).
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvlm.engine.request import RequestOutput
from kvlm.server.async_engine import EngineFailure, Finished
from kvlm.server.chat_turn import ChatTurn, chat_prompt
from kvlm.server.messages_protocol import MESSAGES_PARAMS, CountTokensRequest, MessagesRequest
from kvlm.server.output_blocks import REASONING, TEXT, Block, BlockDelta, BlockEvent, BlockStart, BlockStream, \
    blocks_of
from kvlm.server.protocol import BadRequest, params_renamed
from kvlm.server.model_set import ModelSet
from kvlm.server.served import Choice, ServedModel
from kvlm.server.transport import CLIENT_CLOSED_REQUEST, sse, until_disconnected
from kvlm.tool_calls.chat_output import ChoiceStream


def content_block(block: Block, started: bool = False) -> dict[str, Any]:
    """A block as Anthropic's content block; `started`: as content_block_start announces it (empty)."""
    text = "" if started else block.text
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {} if started else block.arguments()}


def stop_reason(output: RequestOutput, blocks: list[Block]) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the output (if one did)."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if any(b.kind not in (REASONING, TEXT) for b in blocks):
        return "tool_use", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


def usage(output: RequestOutput | None, n_prompt: int) -> dict[str, int]:
    cached = output.n_cached_tokens if output is not None else 0
    return {"input_tokens": n_prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": len(output.token_ids) if output is not None else 0}


def delta(event: BlockDelta) -> dict[str, str]:
    if event.block.kind == REASONING:
        return {"type": "thinking_delta", "thinking": event.piece}
    if event.block.kind == TEXT:
        return {"type": "text_delta", "text": event.piece}
    return {"type": "input_json_delta", "partial_json": event.piece}


def event(kind: str, **fields: Any) -> str:
    return sse({"type": kind, **fields}, kind)


def block_event(change: BlockEvent) -> str:
    if isinstance(change, BlockStart):
        return event("content_block_start", index=change.index, content_block=content_block(change.block, True))
    if isinstance(change, BlockDelta):
        return event("content_block_delta", index=change.index, delta=delta(change))
    return event("content_block_stop", index=change.index)


def add_messages_routes(app: FastAPI, models: ModelSet, authorized: Callable) -> None:
    @app.post("/v1/messages", dependencies=[Depends(authorized)])
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        served = await models.get(body.model)
        with params_renamed(MESSAGES_PARAMS):
            chat = body.chat_request()
            turn = await served.chat_turn(chat)
            [choice] = served.chat_choices(chat, turn, "max_tokens")
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": served.name}
        if body.stream:
            return StreamingResponse(stream(served, turn, choice, message), media_type="text/event-stream")
        output = await until_disconnected(request, served.run(message["id"], choice))
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if output.error:
            raise BadRequest(output.error, "messages")
        blocks = blocks_of(turn.output.message(output.text, output.finish_reason)[0])
        reason, sequence = stop_reason(output, blocks)
        return JSONResponse({**message, "content": [content_block(b) for b in blocks], "stop_reason": reason,
                             "stop_sequence": sequence, "usage": usage(output, len(choice.prompt_token_ids))})

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorized)])
    async def count_tokens(body: CountTokensRequest) -> dict:
        served = await models.get(body.model)
        with params_renamed(MESSAGES_PARAMS):
            chat = body.chat_request()
            prompt = chat_prompt(served.tokenizer, chat, chat.tool_dicts())
        return {"input_tokens": len(served.tokenizer.encode(prompt, add_special_tokens=False))}


async def stream(served: ServedModel, turn: ChatTurn, choice: Choice, message: dict[str, Any]) -> AsyncIterator[str]:
    n_prompt = len(choice.prompt_token_ids)
    yield event("message_start", message={**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                          "usage": usage(None, n_prompt)})
    yield event("ping")
    reader, blocks, output = ChoiceStream(turn.output), BlockStream(), None
    try:
        async for item in served.events(message["id"], choice):
            deltas = reader.last_deltas() if isinstance(item, Finished) else reader.deltas(item.new_text)
            for change in (e for d in deltas for e in blocks.feed(d)):
                yield block_event(change)
            if isinstance(item, Finished):
                output = item.output
    except EngineFailure as exc:
        yield event("error", error={"type": "api_error", "message": str(exc)})
        return
    for change in blocks.close():
        yield block_event(change)
    if output is None or output.error:
        yield event("error", error={"type": "invalid_request_error",
                                    "message": output.error if output else "the request did not finish"})
        return
    reason, sequence = stop_reason(output, blocks.blocks)
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=usage(output, n_prompt))
    yield event("message_stop")
