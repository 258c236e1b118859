"""Reasoning output: the part of an output returned as `reasoning_content`, `<think>...</think>` or the analysis
channel of gpt-oss's harmony messages.

Qwen3 writes `<think>` itself; DeepSeek-R1-style templates (and Qwen3's thinking-only models) open it in the
prompt, so the output starts inside the reasoning and only `</think>` is generated. Reasoning cut off before
`</think>` (max_tokens) is all reasoning, with no content. A prompt that already closed an empty think block
(Qwen3 with enable_thinking=false) gets no parser: all of the output is content. Think-block reasoning is returned
without its surrounding whitespace, content without its leading whitespace.

Qwen3.5 (templates whose tool calls are Qwen3-Coder XML) may open a tool call inside its think block, never writing
`</think>`: there the call ends the reasoning and starts the content, as in vLLM's Qwen3 reasoning parser.

Tool calls and structured output concern the content only; `reasoning_ended` tells the engine where it
starts. Harmony's channels are read as vLLM reads them (kvlm.tool_calls.harmony): text as the model wrote it.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from kvlm.tool_calls import harmony, qwen3_xml
from kvlm.tool_calls.format import held_back
from kvlm.tool_calls.formats import QWEN3_XML, format_for_template

THINK, END_THINK = "<think>", "</think>"
# vLLM's rule for a call inside the think block (Qwen3ReasoningParser, vllm/reasoning/qwen3_reasoning_parser.py at
# vllm-project/vllm 00a4c6a1d828f0de294a8eac028c60a2b522efa2): `<tool_call>` ends the reasoning only when, after
# whitespace, a function tag follows (its _RE_FUNCTION_OPEN, `<function[\s=]`, matched on the lstripped rest), so
# a mere mention of `<tool_call>` in the reasoning does not; the reasoning is the text before `<tool_call>`, the
# content the text from it on.
_CALL_START, _FUNCTION_OPEN = qwen3_xml.START, "<function"
_CALL_OPENING = re.compile(re.escape(_CALL_START) + r"\s*" + re.escape(_FUNCTION_OPEN) + r"[\s=]")


class Reasoning(ABC):
    """Splits an output into reasoning and content, whole or as certain prefixes while streaming."""

    # The markers it reads are special tokens, which the output text must then keep (harmony's are).
    reads_special_tokens: ClassVar[bool] = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for a part that is empty."""
        reasoning, content = self.split_partial(text, final=True)
        return reasoning or None, content if content.strip() else None

    @abstractmethod
    def split_partial(self, text: str, final: bool = False) -> tuple[str, str]:
        """The certain prefixes of the reasoning and the content so far (all of them when `final`)."""

    @abstractmethod
    def reasoning_ended(self, text: str) -> int | None:
        """Where the content starts in the output so far (0 when it has no reasoning); None while it may
        still be reasoning."""


@dataclass(frozen=True)
class ReasoningParser(Reasoning):
    start: str = THINK
    end: str = END_THINK
    starts_open: bool = False  # the prompt opened the reasoning: the output begins inside it
    # A tool call opened before `end` ends the reasoning (Qwen3.5; see _CALL_OPENING). The first of the two ends it:
    # so does vLLM's streaming parser, where its whole-output one looks at the first `<tool_call>` only, and only when
    # the output has no `</think>`; kvlm reads whole outputs as it streams them.
    call_ends_reasoning: bool = False

    def split_partial(self, text: str, final: bool = False) -> tuple[str, str]:
        """Text that may still be a marker is held back, and so is whitespace that may end the reasoning."""
        opened = self._reasoning_start(text, final)
        if opened is None:
            return "", ""
        if opened < 0:
            return "", text
        close = text.find(self.end, opened)
        call = self._call_opening(text, opened, close)
        if call >= 0:
            return text[opened:call].strip(), text[call:]
        if close < 0:
            body = text[opened:]
            body = body if final else body[:len(body) - self._held_back(body)]
            return body.strip(), ""
        return text[opened:close].strip(), text[close + len(self.end):].lstrip()

    def reasoning_ended(self, text: str) -> int | None:
        """Only `end` tells the engine where the content starts: a call opened in the think block is already partly
        written when it ends the reasoning, and the engine's constraint, which starts at the next token, could not
        take it over; such an output is never constrained (its call is read all the same)."""
        opened = self._reasoning_start(text, final=False)
        if opened is None:
            return None
        if opened < 0:
            return 0
        close = text.find(self.end, opened)
        if close < 0 or self._call_opening(text, opened, close) >= 0:
            return None
        return close + len(self.end)

    def _call_opening(self, text: str, opened: int, close: int) -> int:
        """Where a tool call that ends the reasoning starts, before `close` (when >= 0); -1 if none does."""
        if not self.call_ends_reasoning:
            return -1
        call = _CALL_OPENING.search(text, opened, close if close >= 0 else len(text))
        return call.start() if call else -1

    def _held_back(self, body: str) -> int:
        """Length of the end of unclosed reasoning that may still become `end`, or a call that ends it."""
        size = held_back(body, self.end)
        if not self.call_ends_reasoning:
            return size
        call = body.rfind(_CALL_START)  # only the last `<tool_call>` can be followed by nothing but a start of it
        if call >= 0 and _FUNCTION_OPEN.startswith(body[call + len(_CALL_START):].lstrip()):
            return max(size, len(body) - call)
        return max(size, held_back(body, _CALL_START))

    def _reasoning_start(self, text: str, final: bool) -> int | None:
        """Where the reasoning starts (after a `<think>` the output writes); -1 when the output has none; None
        while that is not yet known (the output so far is whitespace or the start of `<think>`)."""
        lead = text.lstrip()
        skipped = len(text) - len(lead)
        if lead.startswith(self.start):
            return skipped + len(self.start)
        if not final and self.start.startswith(lead):
            return None
        return 0 if self.starts_open else -1


@dataclass(frozen=True)
class HarmonyReasoning(Reasoning):
    """gpt-oss's analysis channel is the reasoning; its final channel (and preambles) the content. A response format
    constrains the final message's body."""

    reads_special_tokens: ClassVar[bool] = True

    def split_partial(self, text: str, final: bool = False) -> tuple[str, str]:
        output = harmony.read_output(text, final)
        return output.reasoning, output.content

    def reasoning_ended(self, text: str) -> int | None:
        return harmony.answer_start(text)


def reasoning_for_template(chat_template: str | None, prompt_text: str) -> Reasoning | None:
    """A parser when the template reasons in `<think>` blocks, unless the prompt closed the block already, or in
    harmony's analysis channel. A template that writes calls in Qwen3-Coder's XML (Qwen3.5) also ends the
    reasoning at a call."""
    if harmony.is_harmony_template(chat_template):
        return HarmonyReasoning()
    if not chat_template or THINK not in chat_template:
        return None
    tail = prompt_text.rstrip()
    if tail.endswith(END_THINK):
        return None
    return ReasoningParser(starts_open=tail.endswith(THINK),
                           call_ends_reasoning=format_for_template(chat_template) is QWEN3_XML)


class ReasoningStream:
    """Reasoning and content deltas, from the whole output so far after every token (`update`), then once
    more at the end (`finish`); each call gives (reasoning delta, content delta), either possibly empty."""

    def __init__(self, parser: Reasoning) -> None:
        self._parser = parser
        self.reasoning, self.content = "", ""  # sent so far

    def update(self, text: str) -> tuple[str, str]:
        return self._advance(*self._parser.split_partial(text))

    def finish(self, text: str) -> tuple[str, str]:
        return self._advance(*self._parser.split_partial(text, final=True))

    def _advance(self, reasoning: str, content: str) -> tuple[str, str]:
        reasoning_delta = reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        content_delta = content[len(self.content):] if content.strip() and content.startswith(self.content) else ""
        self.reasoning += reasoning_delta
        self.content += content_delta
        return reasoning_delta, content_delta
