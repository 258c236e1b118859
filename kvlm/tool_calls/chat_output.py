"""One chat choice's generated text as OpenAI returns it: reasoning split off, then tool calls parsed from the
content, whole (`message`) or as stream deltas (`deltas`, `last_deltas`). A format whose calls are channels beside
the reasoning (harmony) reads calls and content from the whole output instead.

finish_reason follows vLLM and OpenAI: "tool_calls" when calls were made under tool_choice auto or required,
"stop" under a named function, and "length" whenever max_tokens cut the output, calls or not. With
`parallel_tool_calls` false, calls after the first are dropped (vLLM's rule; a forcing grammar allows only one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvlm.tool_calls.calls import ParsedOutput
from kvlm.tool_calls.format import ToolCallFormat
from kvlm.tool_calls.reasoning import Reasoning, ReasoningStream
from kvlm.tool_calls.streaming import ContentDelta, ToolCallStream


@dataclass(frozen=True)
class ChatOutputSpec:
    """How a response reads its output; shared by its choices."""

    reasoning: Reasoning | None = None
    tool_format: ToolCallFormat | None = None  # None: no tool calls are looked for
    tools: tuple[dict[str, Any], ...] = ()
    named_tool: bool = False  # tool_choice named one function: finish_reason stays "stop"
    include_reasoning: bool = True
    parallel: bool = True  # parallel_tool_calls

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output text must keep its special tokens: the markers read in it are special tokens."""
        return (self.reasoning is not None and self.reasoning.reads_special_tokens) or \
            (self.tool_format is not None and self.tool_format.reads_special_tokens)

    def calls_source(self, text: str, content: str | None) -> str | None:
        """What tool calls are read from: the content after the reasoning, or the whole output for a format whose
        calls are channels of it."""
        return text if self.tool_format is not None and self.tool_format.reads_channels else content

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole assistant message and the finish_reason to report."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        parsed = ParsedOutput(content, [])
        source = self.calls_source(text, content)
        if self.tool_format is not None and source is not None:
            parsed = self.tool_format.parse(source, self.tools)
            if not self.parallel:
                parsed = ParsedOutput(parsed.content, parsed.calls[:1])
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.calls]
        if reasoning is not None and self.include_reasoning:
            message["reasoning_content"] = reasoning
        return message, self.finish_reason(finish_reason, bool(parsed.calls))

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" and not self.named_tool else reason

    def stream(self) -> ChatOutputStream:
        return ChatOutputStream(self)


class ChatOutputStream:
    """Deltas of one streamed choice, from its whole output text so far after every engine event."""

    def __init__(self, spec: ChatOutputSpec) -> None:
        self._spec = spec
        self._reasoning = ReasoningStream(spec.reasoning) if spec.reasoning else None
        self._calls = ToolCallStream(spec.tool_format, spec.tools) if spec.tool_format else None
        self._content = ""  # the content so far (reasoning split off), which tool calls are parsed from
        self.called = False

    @property
    def plain(self) -> bool:
        """No reasoning and no tools: each event's text is the delta as it is."""
        return self._reasoning is None and self._calls is None

    def deltas(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The OpenAI `delta` objects that `text` (the output so far) adds; `final` at the end of the output."""
        out: list[dict[str, Any]] = []
        content_delta = text[len(self._content):]
        if self._reasoning is not None:
            reasoning_delta, content_delta = (self._reasoning.finish(text) if final else self._reasoning.update(text))
            if reasoning_delta and self._spec.include_reasoning:
                out.append({"reasoning_content": reasoning_delta})
        self._content += content_delta
        if self._calls is None:
            if content_delta:
                out.append({"content": content_delta})
            return out
        source = self._spec.calls_source(text, self._content)
        for delta in self._calls.finish(source) if final else self._calls.update(source):
            if isinstance(delta, ContentDelta):
                out.append({"content": delta.text})
            elif delta.index > 0 and not self._spec.parallel:
                continue
            else:
                self.called = True
                out.append({"tool_calls": [delta.to_openai()]})
        return out


class ChoiceStream:
    """One streamed choice: the engine's event texts gathered and turned into deltas. Without a spec (the
    completions endpoint) a delta is the event's text as it is; in chat, delta objects, the first with the role."""

    def __init__(self, spec: ChatOutputSpec | None) -> None:
        self._spec = spec
        self._stream = spec.stream() if spec is not None else None
        self._text = ""
        self._started = False

    def deltas(self, new_text: str, keep_empty: bool = False) -> list[str | dict[str, Any]]:
        """What this event's text adds; `keep_empty`: one delta even if none (it carries the event's logprobs)."""
        self._text += new_text
        if self._stream is None:
            return [new_text] if new_text or keep_empty else []
        out = self._stream.deltas(self._text)
        if not out and (keep_empty or not self._started):
            out = [{"content": ""}]
        return self._with_role(out)

    def last_deltas(self) -> list[str | dict[str, Any]]:
        """What the end of the output releases (text held back while it might have been a marker)."""
        return [] if self._stream is None else self._with_role(self._stream.deltas(self._text, final=True))

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self._spec is None else self._spec.finish_reason(reason, self._stream.called)

    def _with_role(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if deltas and not self._started:
            deltas[0] = {"role": "assistant", **deltas[0]}
            self._started = True
        return deltas
