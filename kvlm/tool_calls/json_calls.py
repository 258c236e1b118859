"""A call written as a JSON object, `{"name": ..., "arguments": {...}}`: the body of hermes blocks, Llama 3's
calls (which say "parameters"), and the JSON fallback.

A call object has a string name, and arguments that are an object (`{}` when left out); any other key makes
it something else (say, a JSON answer), which is then content.
"""
from __future__ import annotations

import json
from typing import Any

from kvlm.tool_calls.calls import Malformed, PartialCall
from kvlm.tool_calls.grammar import alternatives, json_rule, literal
from kvlm.tool_calls.partial_json import read_value, skip_whitespace


def read_call_object(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[PartialCall, bool, int]:
    """The call object at `pos` (after optional whitespace): the call so far, whether it is whole, its end."""
    pos = skip_whitespace(text, pos)
    if not text.startswith("{", pos):
        if pos < len(text):
            raise Malformed(f"expected a call object at {pos}")
        return PartialCall(None), False, pos
    node, end = read_value(text, pos)
    if set(node.members) - {"name", *argument_keys}:
        raise Malformed(f"a call object has keys {sorted(node.members)}")
    given = [node.members[key] for key in argument_keys if key in node.members]
    if len(given) > 1:
        raise Malformed(f"a call object has more than one of {argument_keys}")
    name = node.members.get("name")
    if name is not None and name.done and not isinstance(name.value, str):
        raise Malformed("a call's name is not a string")
    arguments = given[0] if given else None
    if arguments is not None and arguments.text and not arguments.text.startswith("{"):
        raise Malformed("a call's arguments are not an object")
    if node.done and name is None:
        raise Malformed("a call object without a name")
    call = PartialCall(name.value if name is not None and name.done else None,
                       arguments.text if arguments is not None else "{}" if node.done else "")
    return call, node.done, end


def read_calls(text: str, pos: int, argument_keys: tuple[str, ...], separator: str,
               close: str = "") -> tuple[list[PartialCall], bool, int]:
    """One or more call objects joined by `separator`, then `close` (or the end of the text when empty)."""
    calls: list[PartialCall] = []
    while True:
        call, whole, pos = read_call_object(text, pos, argument_keys)
        calls.append(call)
        pos = skip_whitespace(text, pos)
        if not whole or pos == len(text):
            return calls, whole and not close, pos
        if close and text.startswith(close, pos):
            return calls, True, pos + len(close)
        if not text.startswith(separator, pos):
            raise Malformed(f"expected {separator!r} between calls at {pos}")
        pos = skip_whitespace(text, pos + len(separator))
        if pos == len(text):
            return calls, not close, pos


def call_object_rules(functions: list[tuple[str, dict[str, Any]]], arguments_key: str) -> list[str]:
    """Lark rules: `call_object`, the call object of one of the functions, written as the model's template
    writes it, with the arguments held to that function's parameters schema."""
    names = [f"function_{i}" for i in range(len(functions))]
    rules = [f"call_object: {alternatives(names)}"]
    for rule, (name, parameters) in zip(names, functions):
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{arguments_key}": '
        rules.append(f"{rule}: {literal(head)} {json_rule(parameters, an_object=True)} {literal('}')}")
    return rules
