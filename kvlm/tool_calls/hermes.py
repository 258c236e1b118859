"""Hermes-style calls, Qwen2.5's and Qwen3's format: one block per call,
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, blocks joined by a newline.

In these vocabularies `<tool_call>` and `</tool_call>` are special tokens, so the forcing grammar asks for
those tokens, not the text spelled in pieces.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvlm.tool_calls.calls import Malformed, PartialCall
from kvlm.tool_calls.format import BlockFormat, Tools
from kvlm.tool_calls.grammar import literal, marker, one_or_more
from kvlm.tool_calls.json_calls import call_object_rules, read_call_object
from kvlm.tool_calls.partial_json import skip_whitespace

START, END = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


def read(body: str, tools: Tools) -> tuple[list[PartialCall], bool]:
    call, whole, end = read_call_object(body, 0, ARGUMENT_KEYS)
    if whole and skip_whitespace(body, end) < len(body):
        raise Malformed("text after the call object")
    return [call], whole


def grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
            special_tokens: Collection[str] | None) -> str:
    newline = literal("\n")
    return "\n".join([
        f"start: {one_or_more('call', newline, parallel)}",
        f"call: {marker(START, special_tokens)} {newline} call_object {newline} {marker(END, special_tokens)}",
        *call_object_rules(functions, "arguments"),
    ]) + "\n"


FORMAT = BlockFormat("hermes", read, grammar, start=START, end=END)
