"""Llama 3.x JSON calls: the whole output is `{"name": "f", "parameters": {...}}` (or "arguments"), after an
optional `<|python_tag|>`, several calls joined by `; `.

There is no marker around the calls, so an output is calls only when all of it is: JSON that is not a call,
or prose after a call, makes the whole output content.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from kvlm.tool_calls.calls import PartialCall
from kvlm.tool_calls.format import Tools, WholeOutputFormat
from kvlm.tool_calls.grammar import literal, one_or_more
from kvlm.tool_calls.json_calls import call_object_rules, read_calls

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")
SEPARATOR = ";"


def read(text: str, tools: Tools) -> tuple[list[PartialCall], bool]:
    if PYTHON_TAG.startswith(text):
        return [], False
    start = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
    calls, whole, _ = read_calls(text, start, ARGUMENT_KEYS, SEPARATOR)
    return calls, whole


def grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
            special_tokens: Collection[str] | None) -> str:
    return "\n".join([f"start: {one_or_more('call_object', literal(SEPARATOR + ' '), parallel)}",
                      *call_object_rules(functions, "parameters")]) + "\n"


FORMAT = WholeOutputFormat("llama3_json", read, grammar, opening=re.compile(r'\{\s*"name"\s*:'))
