"""Pythonic calls: a Python list of calls with keyword arguments, `[f(a=1, b="x"), g()]`. Llama 3.2's small
models write the list as their whole output; LFM2 wraps it in `<|tool_call_start|>...<|tool_call_end|>`.

Values are Python literals, read with `ast` and never evaluated; JSON's `true`, `false` and `null` are taken
too, since models write them. Each argument is sent once its value ends.
"""
from __future__ import annotations

import ast
import json
import keyword
import re
from collections.abc import Collection
from typing import Any

from kvlm.tool_calls.calls import Malformed, PartialCall
from kvlm.tool_calls.format import BlockFormat, Tools, WholeOutputFormat
from kvlm.tool_calls.grammar import alternatives, json_rule, literal, marker, one_or_more
from kvlm.tool_calls.partial_json import skip_whitespace

LFM2_START, LFM2_END = "<|tool_call_start|>", "<|tool_call_end|>"
_IDENTIFIER = re.compile(r"[^\W\d]\w*")
_JSON_WORDS = {"true": True, "false": False, "null": None}
_OPENING, _CLOSING = "([{", ")]}"


def read_list(text: str, pos: int) -> tuple[list[PartialCall], bool, int]:
    """The call list at `pos` (after optional whitespace): calls so far, whether the list is whole, its end."""
    pos = skip_whitespace(text, pos)
    if pos == len(text):
        return [], False, pos
    if text[pos] != "[":
        raise Malformed("a call list starts with '['")
    calls: list[PartialCall] = []
    while True:
        call, whole, pos = _read_call(text, skip_whitespace(text, pos + 1))
        calls.append(call)
        pos = skip_whitespace(text, pos)
        if not whole or pos == len(text):
            return calls, False, pos
        if text[pos] == "]":
            return calls, True, pos + 1
        if text[pos] != ",":
            raise Malformed(f"expected ',' or ']' at {pos}")


def _read_call(text: str, pos: int) -> tuple[PartialCall, bool, int]:
    name, pos = _identifier(text, pos)
    if name is None:
        return PartialCall(None), False, pos
    pos = skip_whitespace(text, pos)
    if pos == len(text):
        return PartialCall(None), False, pos
    if text[pos] != "(":
        raise Malformed(f"expected '(' after {name!r}")
    arguments, seen = "{", set()
    while (pos := skip_whitespace(text, pos + 1)) < len(text):
        if text[pos] == ")":
            return PartialCall(name, arguments + "}"), True, pos + 1
        key, pos = _identifier(text, pos)
        pos = skip_whitespace(text, pos)
        if key is None or pos == len(text):
            break
        if text[pos] != "=" or key in seen:
            raise Malformed(f"expected one keyword argument {key}=... at {pos}")
        seen.add(key)
        arguments += (", " if len(seen) > 1 else "") + json.dumps(key, ensure_ascii=False) + ": "
        end = _value_end(text, pos + 1)
        if end is None:
            break
        arguments += json.dumps(literal_value(text[pos + 1:end]), ensure_ascii=False)
        pos = skip_whitespace(text, end)
        if text[pos] == ")":
            return PartialCall(name, arguments + "}"), True, pos + 1
    return PartialCall(name, arguments), False, pos


def _identifier(text: str, pos: int) -> tuple[str | None, int]:
    """A Python name at `pos`; None while it may go on (the text ends there)."""
    match = _IDENTIFIER.match(text, pos)
    if match is None:
        if pos < len(text):
            raise Malformed(f"expected a name at {pos}")
        return None, pos
    if match.end() == len(text):
        return None, pos
    if keyword.iskeyword(match.group()):
        raise Malformed(f"{match.group()!r} is a Python keyword")
    return match.group(), match.end()


def _value_end(text: str, pos: int) -> int | None:
    """Where the value at `pos` ends: the ',' or ')' closing it; None while the text ends inside it."""
    depth, quote = 0, ""
    while pos < len(text):
        char = text[pos]
        if quote:
            if char == "\\":
                pos += 1
            elif text.startswith(quote, pos):
                pos, quote = pos + len(quote) - 1, ""
        elif char in "'\"":
            quote = char * 3 if text.startswith(char * 3, pos) else char
            pos += len(quote) - 1
        elif char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            if depth == 0 and char != ")":
                raise Malformed(f"unbalanced {char!r} at {pos}")
            if depth == 0:
                return pos
            depth -= 1
        elif char == "," and depth == 0:
            return pos
        pos += 1
    return None


def literal_value(source: str) -> Any:
    """The JSON value of a Python literal (or JSON's true/false/null); Malformed for anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as exc:
        raise Malformed(f"not a Python literal: {source!r}") from exc
    return _value(tree)


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_WORDS:
        return _JSON_WORDS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(key, ast.Constant) and isinstance(key.value, str)
                                          for key in node.keys):
        return {key.value: _value(value) for key, value in zip(node.keys, node.values)}
    raise Malformed(f"not a literal: {ast.dump(node)}")


def read_whole(text: str, tools: Tools) -> tuple[list[PartialCall], bool]:
    calls, whole, end = read_list(text, 0)
    if whole and skip_whitespace(text, end) < len(text):
        raise Malformed("text after the call list")
    return calls, whole


def grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
            special_tokens: Collection[str] | None) -> str:
    return "\n".join([f'start: "[" {one_or_more("call", literal(", "), parallel)} "]"',
                      *_call_rules(functions)]) + "\n"


def lfm2_grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
                 special_tokens: Collection[str] | None) -> str:
    calls = one_or_more("call", literal(", "), parallel)
    return "\n".join([f'start: {marker(LFM2_START, special_tokens)} "[" {calls} "]" '
                      f'{marker(LFM2_END, special_tokens)}', *_call_rules(functions)]) + "\n"


def _call_rules(functions: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """A call of one of the functions; keywords in schema order, as Python literals; a function without
    declared properties takes any keywords."""
    names = [f"function_{i}" for i in range(len(functions))]
    rules = [f"call: {alternatives(names)}",
             f'any_argument: /[A-Za-z_][A-Za-z0-9_]*/ "=" {json_rule({})}']
    for i, (rule, (name, parameters)) in enumerate(zip(names, functions)):
        properties = parameters.get("properties")
        if properties is None:
            arguments = f'(any_argument ({literal(", ")} any_argument)*)?'
        else:
            keys = [f"argument_{i}_{j}" for j in range(len(properties))]
            required = set(parameters.get("required") or ())
            arguments = keyword_sequence([(key, prop in required) for key, prop in zip(keys, properties)])
            rules += [f"{key}: {literal(prop + '=')} {_value_rule(schema, parameters)}"
                      for key, (prop, schema) in zip(keys, properties.items())]
        rules.append(f"{rule}: " + " ".join(part for part in (literal(name + "("), arguments, literal(")")) if part))
    return rules


def keyword_sequence(items: list[tuple[str, bool]]) -> str:
    """Lark for the rules in order, joined by ", ", each one optional unless required (True); "" for none.
    One alternative per rule that can come first: the required ones cannot be skipped."""
    if not items:
        return ""
    separator = literal(", ")
    first_required = next((i for i, (_, required) in enumerate(items) if required), None)
    options = []
    for first in range(len(items) if first_required is None else first_required + 1):
        rest = [f"{separator} {rule}" if required else f"({separator} {rule})?"
                for rule, required in items[first + 1:]]
        options.append(" ".join([items[first][0], *rest]))
    return f"({alternatives(options)})" + ("" if first_required is not None else "?")


def _value_rule(schema: dict[str, Any], parameters: dict[str, Any]) -> str:
    """A keyword's value as a Python literal: JSON (a string, number, list or dict of them) but booleans."""
    if schema.get("type") == "boolean":
        return '("True" | "False")'
    definitions = {word: parameters[word] for word in ("$defs", "definitions") if word in parameters}
    return json_rule({**schema, **definitions})


PYTHONIC = WholeOutputFormat("pythonic", read_whole, grammar, opening=re.compile(r"\[\s*[A-Za-z_][\w.]*\("))
LFM2 = BlockFormat("lfm2", read_whole, lfm2_grammar, start=LFM2_START, end=LFM2_END)
