"""What `tools` and `tool_choice` ask of a chat turn, decided once for the server and `LLM.chat`: the format the
model's calls are read in, and the grammar that keeps calls right: for "required" or a named function one that
forces a call, for "auto" one that waits until the model opens a call (llama.cpp's lazy grammars).

As vLLM and OpenAI: "none" reads no calls; "auto" reads them when the model writes them, and needs a model whose
chat template shows a tool-call format; "required" and a named function force one (or, with parallel calls, one
or more) in the model's own format, or as plain JSON for a template without one. Under "auto", once the model
opens a call in its format (the format's `lazy_start`), the rest of the output is the forcing grammar's calls to
the offered tools, arguments valid for their schemas: a call that comes back always parses.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from kvlm.tool_calls.format import ToolCallFormat
from kvlm.tool_calls.formats import JSON_FALLBACK, format_for_template
from kvlm.structured.request_grammar import Triggered
from kvlm.tool_calls.reasoning import Reasoning


@dataclass(frozen=True)
class ToolPlan:
    format: ToolCallFormat | None  # None: no calls are read
    forcing_grammar: str | None  # Lark, for a call the request forces
    named: bool  # a named function: finish_reason stays "stop"
    lazy_grammar: str | None = None  # Lark, for calls the model opens under "auto" (from where they begin)

    @property
    def grammar(self) -> str | None:
        return self.forcing_grammar or self.lazy_grammar

    def constraint_start(self, reasoning: Reasoning | None) -> Callable[[str], int | None] | Triggered | None:
        """For the engine (Engine.add_request): where a constraint on the output starts. After the reasoning, so a
        model thinks freely; from the first token (None) when it has none, or when the forced call's grammar
        writes the reasoning itself (harmony's analysis messages come before the call, in the grammar). A lazy
        grammar starts where a call begins in the content."""
        if self.lazy_grammar is not None:
            return Triggered(lambda text: self._call_start(reasoning, text))
        if reasoning is None or (self.forcing_grammar is not None and self.format.reads_channels):
            return None
        return reasoning.reasoning_ended

    def _call_start(self, reasoning: Reasoning | None, text: str) -> int | None:
        content = 0 if reasoning is None or self.format.reads_channels else reasoning.reasoning_ended(text)
        if content is None:
            return None
        start = self.format.lazy_start(text[content:])
        return None if start is None else content + start


def plan_tools(chat_template: str | None, tools: list[dict[str, Any]], tool_choice: str, parallel: bool,
               special_tokens: Callable[[tuple[str, ...]], Collection[str]]) -> ToolPlan:
    """`tool_choice`: "none", "auto", "required" or a function's name (checked by the caller to be a tool's).
    `special_tokens(markers)`: which of a format's markers are special tokens of the vocabulary. ValueError for
    "auto" on a model without a tool-call format."""
    if not tools or tool_choice == "none":
        return ToolPlan(None, None, False)
    fmt = format_for_template(chat_template)
    forced = tool_choice != "auto"
    if fmt is None and not forced:
        raise ValueError("this model's chat template shows no tool-call format, so its tool calls cannot be read; "
                         "send tool_choice \"required\" or a named function to force a call")
    fmt = fmt or JSON_FALLBACK
    if not forced:
        lazy = fmt.lazy_grammar(tools, parallel, special_tokens(fmt.markers)) if fmt.lazy else None
        return ToolPlan(fmt, None, False, lazy)
    name = None if tool_choice == "required" else tool_choice
    return ToolPlan(fmt, fmt.forcing_grammar(tools, name, parallel, special_tokens(fmt.markers)), name is not None)
