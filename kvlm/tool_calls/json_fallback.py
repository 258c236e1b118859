"""Calls as plain JSON, for a model whose chat template has no tool-call format of its own: used only when
a request forces a call (tool_choice "required" or a named function), never to find calls in free text.

The output is one call object `{"name": "f", "arguments": {...}}`, or a JSON array of them.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvlm.tool_calls.calls import Malformed, PartialCall
from kvlm.tool_calls.format import Tools, WholeOutputFormat
from kvlm.tool_calls.grammar import literal, one_or_more
from kvlm.tool_calls.json_calls import call_object_rules, read_call_object, read_calls
from kvlm.tool_calls.partial_json import skip_whitespace

ARGUMENT_KEYS = ("arguments", "parameters")


def read(text: str, tools: Tools) -> tuple[list[PartialCall], bool]:
    if text.startswith("["):
        calls, whole, end = read_calls(text, 1, ARGUMENT_KEYS, ",", close="]")
    else:
        call, whole, end = read_call_object(text, 0, ARGUMENT_KEYS)
        calls = [call]
    if whole and skip_whitespace(text, end) < len(text):
        raise Malformed("text after the calls")
    return calls, whole


def grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
            special_tokens: Collection[str] | None) -> str:
    start = f'"[" {one_or_more("call_object", literal(", "), True)} "]"' if parallel else "call_object"
    return "\n".join([f"start: {start}", *call_object_rules(functions, "arguments")]) + "\n"


FORMAT = WholeOutputFormat("json_fallback", read, grammar)
