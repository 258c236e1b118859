"""Pieces of the Lark grammars (llguidance's dialect) that force tool calls in a model's own format.

A format's markers are written `<tool_call>` (one special token) when the model's vocabulary has them as
special tokens, as the models a format comes from do; llguidance then accepts only that token, never the
same text spelled in pieces. Arguments are `%json{...}` rules, whitespace bounded as in kvlm.structured.
"""
from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from kvlm.structured.compiler import JSON_WHITESPACE

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def functions(tools: Sequence[dict[str, Any]], name: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(name, parameters schema) of each function tool, or of the one named; a missing schema is any object."""
    found = [(tool["function"]["name"], tool["function"].get("parameters") or ANY_OBJECT)
             for tool in tools if tool.get("type", "function") == "function"]
    if name is not None:
        found = [function for function in found if function[0] == name]
    if not found:
        raise ValueError(f"no function named {name!r} among the tools" if name else "no function tools")
    return found


def parameters_schema(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The parameters schema of function `name`; any object when there is no such function."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return function.get("parameters") or ANY_OBJECT
    return ANY_OBJECT


def literal(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, special_tokens: Collection[str] | None) -> str:
    """A format's marker as a special token, or as text when the vocabulary does not have it as one."""
    return text if special_tokens is None or text in special_tokens else literal(text)


def json_rule(schema: dict[str, Any], *, an_object: bool = False) -> str:
    """`%json{...}` for a schema, with JSON whitespace bounded; `an_object` makes an untyped schema an object.

    Arguments with properties take only those (unless the schema says otherwise), as vLLM's guidance backend and
    OpenAI's strict function calling do: a small model otherwise invents parameters until max_tokens."""
    schema = dict(schema)
    if an_object and "type" not in schema:
        schema["type"] = "object"
    if an_object and "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    schema["x-guidance"] = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
    return "%json" + json.dumps(schema, ensure_ascii=False)


def alternatives(rules: Sequence[str]) -> str:
    return " | ".join(rules)


def one_or_more(rule: str, separator: str, parallel: bool) -> str:
    """One `rule`, or when parallel one or more joined by `separator` (a Lark literal)."""
    return f"{rule} ({separator} {rule})*" if parallel else rule
