"""A tool-call format: where calls sit in a model's output, how to read them, and how to force them.

Formats come in two shapes. Block formats wrap each call (or list of calls) in markers, and text outside the
blocks is content (hermes `<tool_call>`, Qwen3-Coder XML, LFM2 `<|tool_call_start|>`). Whole-output formats
(Llama 3 JSON, pythonic lists, the JSON fallback) have no markers to find, so the output is calls only when
all of it is; otherwise it is content. Harmony (gpt-oss, kvlm.tool_calls.harmony) is neither: its calls are
messages beside the reasoning and the answer, told apart by their headers.

One reader serves finished and partial text: `parse_partial(text, final=False)` gives what is certain so
far (content held back while it may still become a call, arguments as a prefix of their final text), and
`final=True` the finished parse. A block that cannot be a call stays content, markers included.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvlm.tool_calls.calls import Malformed, ParsedOutput, PartialCall, PartialOutput
from kvlm.tool_calls.grammar import functions

Tools = Sequence[dict[str, Any]]
# Reads calls from text: the calls so far, and whether the text is finished calls (Malformed when it cannot be).
Reader = Callable[[str, Tools], tuple[list[PartialCall], bool]]
# Writes the Lark grammar forcing calls: (functions as (name, parameters schema), parallel, special tokens).
GrammarWriter = Callable[[list[tuple[str, dict[str, Any]]], bool, Collection[str] | None], str]


@dataclass(frozen=True)
class ToolCallFormat(ABC):
    name: str
    read: Reader
    grammar: GrammarWriter

    @property
    def markers(self) -> tuple[str, ...]:
        """Texts that are single special tokens in the models of this format (see `forcing_grammar`)."""
        return ()

    @property
    def reads_special_tokens(self) -> bool:
        """Whether its markers are special tokens the output text must keep to be read (Gemma 4's, as vLLM's
        gemma4 parser keeps them); the others' markers are tokens decoding keeps anyway."""
        return False

    @property
    def reads_channels(self) -> bool:
        """Whether calls sit beside the reasoning as channels of one output (harmony) rather than in the content
        after it: the format then reads the whole output, and its forcing grammar writes the reasoning too, so it
        constrains the output from the first token."""
        return False

    def lazy_start(self, text: str) -> int | None:
        """Where a call begins in `text` (the content; the whole output for a format that reads channels), from which
        the forcing grammar constrains the rest under tool_choice auto (llama.cpp's lazy grammars); None while no
        call has begun, and always for a format without a sure sign of one."""
        return None

    @property
    def lazy(self) -> bool:
        """Whether calls can be constrained from where they begin (`lazy_start`)."""
        return False

    def lazy_grammar(self, tools: Tools, parallel: bool = True, special_tokens: Collection[str] | None = None) -> str:
        """Lark grammar of the output from `lazy_start` on: the forcing grammar's calls, for formats whose calls
        begin where their grammar does."""
        return self.forcing_grammar(tools, None, parallel, special_tokens)

    def parse(self, text: str, tools: Tools = ()) -> ParsedOutput:
        """Content and calls (with new ids) of a finished output."""
        return self.parse_partial(text, tools, final=True).finished()

    @abstractmethod
    def parse_partial(self, text: str, tools: Tools = (), final: bool = False) -> PartialOutput:
        """What is certain of the content and calls of `text`, all of it when `final`."""

    def forcing_grammar(self, tools: Tools, name: str | None = None, parallel: bool = True,
                        special_tokens: Collection[str] | None = None) -> str:
        """Lark grammar forcing one call (or, when `parallel`, one or more) to a tool (or the one `name`d),
        arguments constrained by its parameters schema. `special_tokens`: which of `markers` are special tokens
        in the model's vocabulary (None: all, as in the format's models); others are written as text."""
        return self.grammar(functions(tools, name), parallel, special_tokens)


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker`: it may become the marker."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class BlockFormat(ToolCallFormat):
    start: str = ""
    end: str = ""

    @property
    def markers(self) -> tuple[str, ...]:
        return self.start, self.end

    @property
    def lazy(self) -> bool:
        return True

    def lazy_start(self, text: str) -> int | None:
        """The first block's start marker."""
        start = text.find(self.start)
        return start if start >= 0 else None

    def parse_partial(self, text: str, tools: Tools = (), final: bool = False) -> PartialOutput:
        """Segments between calls are content unless all whitespace; a block's text is content when it cannot
        be a call. An unclosed last block is a call when its text is a whole call (the model stopped before
        the end marker), and while streaming until it cannot be one."""
        content: list[str] = []
        calls: list[PartialCall] = []
        segment, pos = "", 0
        while (start := text.find(self.start, pos)) >= 0:
            segment += text[pos:start]
            inside = start + len(self.start)
            end = text.find(self.end, inside)
            block_end = len(text) if end < 0 else end + len(self.end)
            body = text[inside:block_end if end < 0 else end]
            if end < 0 and not final:
                body = body[:len(body) - held_back(body, self.end)]
            found = self._calls_in(body, tools, streaming=end < 0 and not final)
            if found is None:
                segment += text[start:block_end]
            else:
                if segment.strip():
                    content.append(segment)
                calls.extend(found)
                segment = ""
            pos = block_end
        tail = text[pos:]
        segment += tail if final else tail[:len(tail) - held_back(tail, self.start)]
        if segment.strip():
            content.append(segment)
        return PartialOutput("".join(content), calls)

    def _calls_in(self, body: str, tools: Tools, streaming: bool) -> list[PartialCall] | None:
        """The calls of a block's text; None when it is not calls (nor can become calls, while `streaming`)."""
        try:
            found, whole = self.read(body, tools)
        except Malformed:
            return None
        return found if whole or streaming else None


@dataclass(frozen=True)
class WholeOutputFormat(ToolCallFormat):
    # how calls open, where nothing but a call could (`{"name":`, `[get_weather(`): an output that starts so is calls,
    # constrained as such from its start (JSON or a list that is not a call stays free, and content)
    opening: re.Pattern | None = None

    @property
    def lazy(self) -> bool:
        return self.opening is not None

    def lazy_start(self, text: str) -> int | None:
        start = len(text) - len(text.lstrip())
        return start if self.opening is not None and self.opening.match(text, start) else None

    def parse_partial(self, text: str, tools: Tools = (), final: bool = False) -> PartialOutput:
        """Calls when the whole output (leading whitespace aside) is calls; while streaming, nothing is sent
        until the text is clearly prose (then all of it is content) or calls begin."""
        try:
            calls, whole = self.read(text.lstrip(), tools) if text.strip() else ([], False)
        except Malformed:
            return PartialOutput(text, [])
        if final and not whole:
            return PartialOutput(text, [])
        return PartialOutput("", calls)
