"""Streamed tool calls: OpenAI deltas found by re-parsing the accumulated output after every token.

llama.cpp's approach: parse all the text so far (`parse_partial`, which gives only what is certain) and send
what it adds to what was sent. Content that may still turn into a call marker is held back; a call's id and
name go out once, whole, in its first delta; its arguments go out as fragments that only ever append, so
per call they concatenate to exactly the `arguments` of the finished parse.

What was sent is never taken back. When the finished parse contradicts it (an announced call that turns out
malformed or is cut off by max_tokens, prose after Llama 3 calls), the stream sends only what extends what
it sent: the call stays, with the arguments it had, and content that would rewrite sent content is dropped.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kvlm.tool_calls.calls import ParsedOutput, PartialOutput, ToolCall, new_call_id
from kvlm.tool_calls.format import ToolCallFormat, Tools


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # id and name: in the call's first delta only
    name: str | None = None
    arguments: str = ""  # the next fragment of the arguments text

    def to_openai(self) -> dict[str, Any]:
        """The delta's entry in `choices[].delta.tool_calls`."""
        function: dict[str, Any] = {"arguments": self.arguments}
        head: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            head |= {"id": self.id, "type": "function"}
            function = {"name": self.name, **function}
        return {**head, "function": function}


Delta = ContentDelta | ToolCallDelta


class ToolCallStream:
    """Feed it the whole output so far after every token (`update`), then once more at the end (`finish`)."""

    def __init__(self, format: ToolCallFormat, tools: Tools = ()) -> None:
        self._format, self._tools = format, tools
        self._content = ""
        self._calls: list[ToolCall] = []  # as sent: arguments so far

    def update(self, text: str) -> list[Delta]:
        return self._advance(self._format.parse_partial(text, self._tools))

    def finish(self, text: str) -> list[Delta]:
        return self._advance(self._format.parse_partial(text, self._tools, final=True))

    def result(self) -> ParsedOutput:
        """What was sent, assembled: after `finish`, the finished parse (unless it contradicted the stream)."""
        return ParsedOutput(self._content or None, list(self._calls))

    def _advance(self, target: PartialOutput) -> list[Delta]:
        deltas: list[Delta] = []
        if target.content.strip() and target.content.startswith(self._content) and target.content != self._content:
            deltas.append(ContentDelta(target.content[len(self._content):]))
            self._content = target.content
        for index, call in enumerate(target.calls):
            if call.name is None:
                break
            if index == len(self._calls):
                self._calls.append(ToolCall(call.name, call.arguments, new_call_id()))
                deltas.append(ToolCallDelta(index, self._calls[index].id, call.name, call.arguments))
                continue
            sent = self._calls[index]
            if sent.name != call.name:
                break
            if call.arguments.startswith(sent.arguments) and call.arguments != sent.arguments:
                deltas.append(ToolCallDelta(index, arguments=call.arguments[len(sent.arguments):]))
                self._calls[index] = replace(sent, arguments=call.arguments)
        return deltas


def assemble(deltas: Iterable[Delta]) -> ParsedOutput:
    """What a client rebuilds from the deltas: content joined, each call's fragments joined."""
    content, calls = "", {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content += delta.text
        elif delta.id is not None:
            calls[delta.index] = ToolCall(delta.name or "", delta.arguments, delta.id)
        else:
            calls[delta.index] = replace(calls[delta.index], arguments=calls[delta.index].arguments + delta.arguments)
    return ParsedOutput(content or None, [calls[index] for index in sorted(calls)])


def stream_parse(format: ToolCallFormat, pieces: Iterable[str], tools: Tools = ()) -> tuple[ParsedOutput, list[Delta]]:
    """Streams an output given piece by piece (each token's text); the assembled result and the deltas."""
    stream, text, deltas = ToolCallStream(format, tools), "", []
    for piece in pieces:
        text += piece
        deltas += stream.update(text)
    deltas += stream.finish(text)
    return assemble(deltas), deltas
