"""A chat turn's output as a sequence of blocks: reasoning, text, one block per tool call. The Responses API calls
them output items and the Messages API content blocks; both stream a block's start, its pieces and its end.

`BlockStream` regroups the chat deltas of `ChoiceStream` (reasoning_content, content, tool_calls) into block
events; `blocks_of` reads a whole chat message the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


@dataclass
class Block:
    kind: str  # REASONING, TEXT or TOOL_CALL
    text: str = ""  # the reasoning or text, or a call's arguments (JSON)
    call_id: str | None = None  # tool calls only
    name: str | None = None

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object ({} where the model wrote none, or cut them off)."""
        try:
            value = json.loads(self.text) if self.text.strip() else {}
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class BlockStart:
    index: int
    block: Block


@dataclass(frozen=True)
class BlockDelta:
    index: int
    block: Block
    piece: str


@dataclass(frozen=True)
class BlockStop:
    index: int
    block: Block


BlockEvent = BlockStart | BlockDelta | BlockStop


@dataclass
class BlockStream:
    """Feed it each chat delta (`feed`), then `close`; `blocks` is everything streamed, as it was sent."""

    blocks: list[Block] = field(default_factory=list)
    _open: bool = False
    _calls: dict[int, int] = field(default_factory=dict)  # a tool call's index -> its block's index

    def feed(self, delta: dict[str, Any]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if delta.get("reasoning_content"):
            events += self._append(REASONING, delta["reasoning_content"])
        if delta.get("content"):
            events += self._append(TEXT, delta["content"])
        for call in delta.get("tool_calls") or ():
            function = call["function"]
            if call.get("id") is not None:
                events += self._start(Block(TOOL_CALL, call_id=call["id"], name=function["name"]))
                self._calls[call["index"]] = len(self.blocks) - 1
            if function.get("arguments"):
                events += self._extend(self._calls[call["index"]], function["arguments"])
        return events

    def close(self) -> list[BlockEvent]:
        if not self._open:
            return []
        self._open = False
        return [BlockStop(len(self.blocks) - 1, self.blocks[-1])]

    def _append(self, kind: str, piece: str) -> list[BlockEvent]:
        events = [] if self._open and self.blocks[-1].kind == kind else self._start(Block(kind))
        return events + self._extend(len(self.blocks) - 1, piece)

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self._open = True
        return events + [BlockStart(len(self.blocks) - 1, block)]

    def _extend(self, index: int, piece: str) -> list[BlockEvent]:
        block = self.blocks[index]
        block.text += piece
        return [BlockDelta(index, block, piece)]


def blocks_of(message: dict[str, Any]) -> list[Block]:
    """A whole assistant message (ChatOutputSpec.message) as blocks: its reasoning, its text, then its calls."""
    blocks = []
    if message.get("reasoning_content"):
        blocks.append(Block(REASONING, message["reasoning_content"]))
    if message.get("content"):
        blocks.append(Block(TEXT, message["content"]))
    for call in message.get("tool_calls") or ():
        blocks.append(Block(TOOL_CALL, call["function"]["arguments"], call["id"], call["function"]["name"]))
    return blocks
