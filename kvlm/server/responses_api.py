"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed as typed events), `GET` and `DELETE
/v1/responses/{id}`, and `previous_response_id` over the responses kept in memory.

A response runs as one chat turn (responses_protocol); its output blocks (output_blocks) become output items:
`reasoning` (its text as reasoning_text content), `message` (output_text) and one `function_call` per call. A
response cut by max_output_tokens is "incomplete" (incomplete_details.reason "max_output_tokens"), streamed with
`response.incomplete` as OpenAI does; every other ends with `response.completed`.

Stored responses (`store`, true by default as OpenAI's) keep their whole conversation, so that a next request can
continue it by id; at most STORED_RESPONSES of them and STORED_BYTES of conversation, least recently used out.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvlm.engine.request import RequestOutput
from kvlm.server.async_engine import EngineFailure, Finished
from kvlm.server.chat_turn import ChatTurn
from kvlm.server.output_blocks import REASONING, TEXT, TOOL_CALL, Block, BlockDelta, BlockEvent, BlockStart, BlockStream, \
    blocks_of
from kvlm.server.protocol import BadRequest, params_renamed
from kvlm.server.responses_protocol import RESPONSES_PARAMS, ResponsesRequest, input_messages
from kvlm.server.model_set import ModelSet
from kvlm.server.served import Choice, ServedModel
from kvlm.server.transport import CLIENT_CLOSED_REQUEST, sse, until_disconnected
from kvlm.tool_calls.chat_output import ChoiceStream

STORED_RESPONSES = 1024
STORED_BYTES = 256 * 2**20
ITEM_PREFIXES = {REASONING: "rs", TEXT: "msg"}  # and "fc" for function calls


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: the input so far and this response's output
    n_bytes: int = 0


@dataclass
class ResponseStore:
    """Responses kept for GET and previous_response_id, bounded in count and bytes, least recently used out."""

    max_entries: int = STORED_RESPONSES
    max_bytes: int = STORED_BYTES
    _entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def put(self, stored: Stored) -> None:
        stored.n_bytes = len(json.dumps(stored.conversation)) + len(json.dumps(stored.response))
        self._entries[stored.response["id"]] = stored
        self._bytes += stored.n_bytes
        while len(self._entries) > self.max_entries or (self._bytes > self.max_bytes and len(self._entries) > 1):
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.n_bytes

    def get(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self._entries.get(response_id)
        if stored is None:
            raise BadRequest(f"No response with id '{response_id}' is stored here (responses are kept in memory, "
                             f"at most {self.max_entries}, and lost on restart)", param, status=404)
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self._bytes -= self.get(response_id).n_bytes
        del self._entries[response_id]


class ResponseReply:
    """One response's identity and body, as it runs and when it is done."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body, self.model = body, model
        self.id, self.created_at = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.item_ids: dict[int, str] = {}  # block index -> its output item's id
        self.sequence_number = 0

    def item_id(self, index: int, block: Block) -> str:
        if index not in self.item_ids:
            self.item_ids[index] = f"{ITEM_PREFIXES.get(block.kind, 'fc')}_{uuid.uuid4().hex}"
        return self.item_ids[index]

    def item(self, index: int, block: Block, status: str = "completed") -> dict[str, Any]:
        item_id = self.item_id(index, block)
        done = status != "in_progress"
        if block.kind == REASONING:
            content = [{"type": "reasoning_text", "text": block.text}] if done else []
            return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
        if block.kind == TEXT:
            content = [output_text(block.text)] if done else []
            return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
        return {"id": item_id, "type": "function_call", "call_id": block.call_id, "name": block.name,
                "arguments": block.text if done else "", "status": status}

    def response(self, status: str, blocks: list[Block], output: RequestOutput | None = None,
                 reasoning_tokens: int = 0) -> dict[str, Any]:
        body, incomplete = self.body, status == "incomplete"
        items = [self.item(i, b, "incomplete" if incomplete and i == len(blocks) - 1 else "completed")
                 for i, b in enumerate(blocks)]
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": items, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store, "temperature": body.temperature, "text": {"format": text_format},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
            "truncation": "disabled", "usage": usage(output, reasoning_tokens) if output is not None else None,
            "user": body.user, "metadata": body.metadata or {}}

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence_number += 1
        return sse({"type": kind, "sequence_number": self.sequence_number - 1, **fields}, kind)

    def block_events(self, event: BlockEvent) -> list[str]:
        """A block's start, piece or end as the Responses API's typed events."""
        index, block = event.index, event.block
        where = {"item_id": self.item_id(index, block), "output_index": index}
        text_part = {"content_index": 0, **where}
        if isinstance(event, BlockStart):
            events = [self.event("response.output_item.added", output_index=index,
                                 item=self.item(index, block, "in_progress"))]
            if block.kind != TOOL_CALL:
                events.append(self.event("response.content_part.added", **text_part, part=part(block, "")))
            return events
        if isinstance(event, BlockDelta):
            if block.kind == REASONING:
                return [self.event("response.reasoning_text.delta", **text_part, delta=event.piece)]
            if block.kind == TEXT:
                return [self.event("response.output_text.delta", **text_part, delta=event.piece, logprobs=[])]
            return [self.event("response.function_call_arguments.delta", **where, delta=event.piece)]
        if block.kind == REASONING:
            events = [self.event("response.reasoning_text.done", **text_part, text=block.text)]
        elif block.kind == TEXT:
            events = [self.event("response.output_text.done", **text_part, text=block.text, logprobs=[])]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=block.name,
                                 arguments=block.text)]
        if block.kind != TOOL_CALL:
            events.append(self.event("response.content_part.done", **text_part, part=part(block, block.text)))
        return events + [self.event("response.output_item.done", output_index=index, item=self.item(index, block))]


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def part(block: Block, text: str) -> dict[str, Any]:
    return output_text(text) if block.kind == TEXT else {"type": "reasoning_text", "text": text}


def usage(output: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    n_in, n_out = len(output.prompt_token_ids), len(output.token_ids)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": output.n_cached_tokens},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": n_in + n_out}


def assistant_message(blocks: list[Block]) -> dict[str, Any]:
    """The output as the chat message a continuing response sends back to the template."""
    texts = {kind: "".join(b.text for b in blocks if b.kind == kind) or None for kind in (REASONING, TEXT)}
    message: dict[str, Any] = {"role": "assistant", "content": texts[TEXT]}
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text or "{}"}}
             for b in blocks if b.kind == TOOL_CALL]
    if calls:
        message["tool_calls"] = calls
    if texts[REASONING]:
        message["reasoning_content"] = texts[REASONING]
    return message


def add_responses_routes(app: FastAPI, models: ModelSet,
                         authorized: Callable) -> ResponseStore:
    store = ResponseStore()

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        served = await models.get(body.model)
        history = store.get(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id else []
        messages = history + input_messages(body.input)
        with params_renamed(RESPONSES_PARAMS):
            chat = body.chat_request(messages)
            turn = await served.chat_turn(chat, "input")
            [choice] = served.chat_choices(chat, turn, "max_output_tokens", "input")
        reply = ResponseReply(body, served.name)
        run = Run(served, reply, turn, choice, messages, store if body.store else None)
        if body.stream:
            return StreamingResponse(run.stream(), media_type="text/event-stream")
        output = await until_disconnected(request, served.run(reply.id, choice))
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if output.error:
            raise BadRequest(output.error, "input")
        message, _ = turn.output.message(output.text, output.finish_reason)
        return JSONResponse(run.finished(blocks_of(message), output))

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def get_response(response_id: str) -> dict:
        return store.get(response_id).response

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete_response(response_id: str) -> dict:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return store


@dataclass
class Run:
    """One response being generated: streamed or whole, and stored when it ends."""

    served: ServedModel
    reply: ResponseReply
    turn: ChatTurn
    choice: Choice
    messages: list[dict[str, Any]]  # the conversation it answers, without instructions
    store: ResponseStore | None

    def finished(self, blocks: list[Block], output: RequestOutput) -> dict[str, Any]:
        status = "incomplete" if output.finish_reason == "length" else "completed"
        reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
        n_reasoning = len(self.served.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        response = self.reply.response(status, blocks, output, n_reasoning)
        if self.store is not None:
            self.store.put(Stored(response, self.messages + [assistant_message(blocks)]))
        return response

    async def stream(self) -> AsyncIterator[str]:
        reply = self.reply
        yield reply.event("response.created", response=reply.response("in_progress", []))
        yield reply.event("response.in_progress", response=reply.response("in_progress", []))
        reader, blocks = ChoiceStream(self.turn.output), BlockStream()
        output = None
        try:
            async for item in self.served.events(reply.id, self.choice):
                deltas = reader.last_deltas() if isinstance(item, Finished) else reader.deltas(item.new_text)
                for event in (e for delta in deltas for e in blocks.feed(delta)):
                    for text in reply.block_events(event):
                        yield text
                if isinstance(item, Finished):
                    output = item.output
        except EngineFailure as exc:
            yield reply.event("error", code="server_error", message=str(exc), param=None)
            return
        for event in blocks.close():
            for text in reply.block_events(event):
                yield text
        if output is None or output.error:
            yield reply.event("error", code="invalid_request_error", message=output.error if output else "the request did not finish",
                              param="input")
            return
        response = self.finished(blocks.blocks, output)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield reply.event(kind, response=response)
