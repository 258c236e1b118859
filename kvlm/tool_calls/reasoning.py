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

from kvlm.tool_calls import gemma4, harmony, qwen3_xml
from kvlm.tool_calls.format import held_back
from kvlm.tool_calls.formats import QWEN3_XML, format_for_template

THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class CallOpening:
    """A tool call that, opened in unclosed reasoning, ends it: `marker`, then after any whitespace `follows` (a
    mere mention of the marker does not). The reasoning is the text before the marker, the content from it on."""

    marker: str
    follows: str
    pattern: re.Pattern


# vLLM's rule for Qwen3.5 (Qwen3ReasoningParser, vllm/reasoning/qwen3_reasoning_parser.py at vllm-project/vllm
# 00a4c6a1d828f0de294a8eac028c60a2b522efa2): `<tool_call>`, then after whitespace a function tag (its
# _RE_FUNCTION_OPEN, `<function[\s=]`, matched on the lstripped rest).
QWEN35_CALL = CallOpening(qwen3_xml.START, "<function",
                          re.compile(re.escape(qwen3_xml.START) + r"\s*" + re.escape("<function") + r"[\s=]"))
# Gemma 4's (Gemma4ReasoningParser.is_reasoning_end, vllm/reasoning/gemma4_reasoning_parser.py at vllm-project/vllm
# 109eefd646368f8aa282b251a815c04fd5922975: a `<|tool_call>` ends the reasoning), kvlm's when followed by `call:`.
GEMMA4_CALL = CallOpening(gemma4.START, gemma4.CALL, re.compile(re.escape(gemma4.START) + r"\s*" + gemma4.CALL))


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
    # A tool call opened before `end` ends the reasoning (Qwen3.5, Gemma 4; see CallOpening). The first of the two
    # ends it: so does vLLM's streaming parser, where its whole-output one looks at the first call marker only, and
    # only when the output has no end marker; kvlm reads whole outputs as it streams them.
    call_opening: CallOpening | None = None
    label: str = ""  # a role label the reasoning opens with, not returned (Gemma 4's "thought\n")

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
            return self._unlabelled(text[opened:call], True).strip(), text[call:]
        if close < 0:
            body = text[opened:]
            body = body if final else body[:len(body) - self._held_back(body)]
            return self._unlabelled(body, final).strip(), ""
        return self._unlabelled(text[opened:close], True).strip(), text[close + len(self.end):].lstrip()

    def _unlabelled(self, reasoning: str, whole: bool) -> str:
        """The reasoning without its label; nothing while it may still be the label's start (unless `whole`)."""
        if self.label and reasoning.startswith(self.label):
            return reasoning[len(self.label):]
        return "" if not whole and self.label.startswith(reasoning) else reasoning

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
        if self.call_opening is None:
            return -1
        call = self.call_opening.pattern.search(text, opened, close if close >= 0 else len(text))
        return call.start() if call else -1

    def _held_back(self, body: str) -> int:
        """Length of the end of unclosed reasoning that may still become `end`, or a call that ends it."""
        size = held_back(body, self.end)
        if self.call_opening is None:
            return size
        marker, follows = self.call_opening.marker, self.call_opening.follows
        call = body.rfind(marker)  # only the last marker can be followed by nothing but a start of what follows it
        if call >= 0 and follows.startswith(body[call + len(marker):].lstrip()):
            return max(size, len(body) - call)
        return max(size, held_back(body, marker))

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


@dataclass(frozen=True)
class Gemma4Reasoning(ReasoningParser):
    """Gemma 4's thought channel, `<|channel>thought\n...<channel|>`, as vLLM's gemma4 reasoning parser reads it: the
    label taken off; its markers are special tokens the output text keeps."""

    reads_special_tokens: ClassVar[bool] = True
    start: str = "<|channel>"
    end: str = "<channel|>"
    label: str = "thought\n"
    call_opening: CallOpening | None = GEMMA4_CALL


def reasoning_for_template(chat_template: str | None, prompt_text: str) -> Reasoning | None:
    """A parser when the template reasons in `<think>` blocks (or Gemma 4's thought channel), unless the prompt
    closed the block already, or in harmony's analysis channel. A template that writes calls in Qwen3-Coder's XML
    (Qwen3.5) also ends the reasoning at a call."""
    if harmony.is_harmony_template(chat_template):
        return HarmonyReasoning()
    if chat_template and Gemma4Reasoning.start in chat_template:
        return None if prompt_text.rstrip().endswith(Gemma4Reasoning.end) else Gemma4Reasoning()
    if not chat_template or THINK not in chat_template:
        return None
    tail = prompt_text.rstrip()
    if tail.endswith(END_THINK):
        return None
    return ReasoningParser(starts_open=tail.endswith(THINK),
                           call_opening=QWEN35_CALL if format_for_template(chat_template) is QWEN3_XML else None)


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
