"""Gemma 4's calls: one block per call, `<|tool_call>call:NAME{key:value,...}<tool_call|>`, blocks back to back.

Arguments are Gemma's own notation, not JSON: keys bare, strings between `<|"|>` quotes (one token in Gemma 4's
vocabulary), objects `{...}` and arrays `[...]` as in JSON, bare numbers, true, false and null. They are read as
vLLM's gemma4 tool parser reads them (`_parse_gemma4_args`, vllm/tool_parsers/gemma4_tool_parser.py at
vllm-project/vllm 027004de3715411197be51ced325705abcf740a7): a quoted key is its text; a bare value is true or
false as written, null for null/none/nil in any case, a float when it has a ".", an integer when int() reads it, else
the text itself. Where kvlm is stricter: a call must be whole (braces closed, nothing after them) to be a call, a
key given twice is no call (its streamed arguments could not stay a prefix), and a number too large for a finite
float stays text.

Streaming: each whole key-value pair of the top level as it ends, and a string value's text as it comes.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Collection
from typing import Any

from kvlm.tool_calls.calls import Malformed, PartialCall
from kvlm.tool_calls.format import BlockFormat, Tools, held_back
from kvlm.tool_calls.grammar import alternatives, literal, marker

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CALL = "call:"
_NAME = re.compile(r"[\w\-.]+")
_BARE_END = ",}]"
_SKIPPED = " \n\t,"  # between pairs and items, as vLLM skips them


class _Cut(Exception):
    """The text ends inside a value (streaming)."""


def _value(text: str, pos: int) -> tuple[Any, int]:
    """A value starting at `pos` (whitespace skipped) and where it ends; _Cut when the text ends inside it."""
    while pos < len(text) and text[pos] in " \n\t":
        pos += 1
    if pos >= len(text) or QUOTE.startswith(text[pos:]):
        raise _Cut
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise _Cut
        return text[pos + len(QUOTE):end], end + len(QUOTE)
    if text[pos] == "{":
        return _object(text, pos + 1)
    if text[pos] == "[":
        return _array(text, pos + 1)
    end = pos
    while end < len(text) and text[end] not in _BARE_END:
        end += 1
    if end >= len(text):
        raise _Cut
    return _bare(text[pos:end].strip()), end


def _bare(value: str) -> Any:
    """vLLM's reading of a value without quotes."""
    if not value:
        raise Malformed("a key without a value")
    if value in ("true", "false"):
        return value == "true"
    if value.lower() in ("null", "none", "nil"):
        return None
    try:
        number = float(value) if "." in value else int(value)
    except ValueError:
        return value
    return number if math.isfinite(number) else value


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SKIPPED:
        pos += 1
    return pos


def _key(text: str, pos: int) -> tuple[str, int]:
    """A key up to its `:` (a quoted one as its text); _Cut while the `:` has not come."""
    colon = text.find(":", pos)
    if colon < 0:
        raise _Cut
    key = text[pos:colon].strip()
    if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
        key = key[len(QUOTE):-len(QUOTE)]
    if not key or any(c in key for c in "{}[],"):
        raise Malformed(f"bad key {key!r}")
    return key, colon + 1


def _object(text: str, pos: int) -> tuple[dict[str, Any], int]:
    """An object's pairs after its `{`, and where its `}` ends."""
    pairs: dict[str, Any] = {}
    while (pos := _skip(text, pos)) < len(text):
        if text[pos] == "}":
            return pairs, pos + 1
        key, pos = _key(text, pos)
        if key in pairs:
            raise Malformed(f"key {key!r} given twice")
        pairs[key], pos = _value(text, pos)
    raise _Cut


def _array(text: str, pos: int) -> tuple[list[Any], int]:
    items: list[Any] = []
    while (pos := _skip(text, pos)) < len(text):
        if text[pos] == "]":
            return items, pos + 1
        item, pos = _value(text, pos)
        items.append(item)
    raise _Cut


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _streamed_arguments(text: str, pos: int) -> str:
    """The certain start of the arguments JSON of an unfinished `{...}` starting after its `{` at `pos`: the whole
    pairs, then the key and text so far of a string value under way."""
    arguments, seen = "{", set()
    while (pos := _skip(text, pos)) < len(text):
        try:
            key, after_key = _key(text, pos)
        except _Cut:
            break
        if key in seen:
            raise Malformed(f"key {key!r} given twice")
        head = (", " if seen else "") + _dumps(key) + ": "
        try:
            value, pos = _value(text, after_key)
        except _Cut:
            return arguments + _partial_string(text, after_key, head)
        seen.add(key)
        arguments += head + _dumps(value)
    return arguments


def _partial_string(text: str, pos: int, head: str) -> str:
    """`head` and the JSON of a string value's text so far (no closing quote), or nothing for any other value."""
    rest = text[pos:].lstrip(" \n\t")
    if not rest.startswith(QUOTE):
        return ""
    body = rest[len(QUOTE):]
    return head + _dumps(body[:len(body) - held_back(body, QUOTE)])[:-1]


def read(body: str, tools: Tools) -> tuple[list[PartialCall], bool]:
    if not body.startswith(CALL):
        if CALL.startswith(body):
            return [PartialCall(None)], False
        raise Malformed("a call block without call:")
    name = _NAME.match(body, len(CALL))
    end_of_name = name.end() if name else len(CALL)
    if end_of_name == len(body):
        return [PartialCall(None)], False
    if not name or body[end_of_name] != "{":
        raise Malformed("a call without a name and its {")
    try:
        arguments, end = _object(body, end_of_name + 1)
    except _Cut:
        return [PartialCall(name.group(), _streamed_arguments(body, end_of_name + 1))], False
    if body[end:].strip():
        raise Malformed("text after the call's }")
    return [PartialCall(name.group(), _dumps(arguments))], True


# --- forcing calls: Gemma's notation of the tool's parameters schema ---

def grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
            special_tokens: Collection[str] | None) -> str:
    """Arguments in the notation the template writes past calls in (keys in sorted order, as its dictsort), the
    required ones present, values of their schema's type; a schema kvlm cannot follow (no type, a union, a
    reference) takes any value."""
    writer = _GrammarWriter(marker(QUOTE, special_tokens))
    names = [writer.function(name, parameters) for name, parameters in functions]
    return "\n".join([f"start: {'call+' if parallel else 'call'}",
                      f"call: {marker(START, special_tokens)} ({alternatives(names)}) {marker(END, special_tokens)}",
                      *writer.rules]) + "\n"


NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _GrammarWriter:
    """Lark rules for values of schemas, named value_1, value_2, ... as they are written; `quote`: the string
    quote as a special token, or as text (then a string's text ends at the first quote: a lazy match)."""

    def __init__(self, quote: str) -> None:
        self.quote = quote
        if quote == QUOTE:  # a token: the text between two of them is anything
            strings = [f"string: {quote} /(.|\\n)*/ {quote}"]
        else:  # text: a lazy match up to the closing quote, which it takes
            strings = [f"string: {quote} string_text", f"string_text[suffix={quote}]: /(.|\\n)*/"]
        self.rules = [*strings,
                      'integer: /-?(0|[1-9][0-9]*)/',
                      'number: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?/',
                      'boolean: "true" | "false"',
                      'null: "null"',
                      'any: string | number | boolean | null | any_object | any_array',
                      'any_object: "{" (any_pair ("," any_pair)*)? "}"',
                      'any_pair: /[A-Za-z_][A-Za-z0-9_]*/ ":" any',
                      'any_array: "[" (any ("," any)*)? "]"']
        self._count = 0

    def function(self, name: str, parameters: dict[str, Any]) -> str:
        rule = self._new()
        self.rules.append(f"{rule}: {literal(CALL + name)} {self._object(parameters)}")
        return rule

    def _new(self) -> str:
        self._count += 1
        return f"value_{self._count}"

    def value(self, schema: dict[str, Any]) -> str:
        kind = schema.get("type")
        if "enum" in schema and all(isinstance(choice, str) for choice in schema["enum"]):
            return "(" + alternatives([f"{self.quote} {literal(choice)} {self.quote}"
                                       for choice in schema["enum"]]) + ")"
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            item = self.value(schema.get("items") or {})
            return f'"[" ({item} ("," {item})*)? "]"'
        bounds = {key: schema[key] for key in NUMBER_BOUNDS if key in schema}
        if kind == "integer" and bounds:  # bare integers are JSON's: llguidance keeps them in bounds
            # (not numbers: JSON may write one with an exponent, which Gemma's notation reads back as text)
            return "%json" + json.dumps({"type": kind, **bounds, "x-guidance": {"whitespace_flexible": False}})
        return {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean",
                "null": "null"}.get(kind, "any") if isinstance(kind, str) or kind is None else "any"

    def _object(self, schema: dict[str, Any]) -> str:
        """`{pairs}`: the properties in sorted order, each required one present, commas between those present;
        an object without declared properties takes any pairs."""
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return "any_object"
        required = set(schema.get("required") or ())
        keys = sorted(properties)
        pairs = {key: f"{literal(key + ':')} {self.value(properties[key] or {})}" for key in keys}
        rule = self._new()
        self.rules.append(f"{rule}: \"{{\" {self._pairs(keys, pairs, required)} \"}}\"")
        return rule

    def _pairs(self, keys: list[str], pairs: dict[str, str], required: set[str]) -> str:
        """The pairs in order, the required ones present: the first present one without a comma, any later one
        after a comma."""
        def after(index: int) -> str:
            return " ".join(f'"," {pairs[key]}' if key in required else f'("," {pairs[key]})?'
                            for key in keys[index:])
        firsts = []
        for index, key in enumerate(keys):
            firsts.append(f"{pairs[key]} {after(index + 1)}".strip())
            if key in required:
                break
        else:
            firsts.append("")  # none required: no pair at all
        return "(" + alternatives([first or '""' for first in firsts]) + ")"


class Gemma4Format(BlockFormat):
    @property
    def markers(self) -> tuple[str, ...]:
        return START, END, QUOTE

    @property
    def reads_special_tokens(self) -> bool:
        return True


FORMAT = Gemma4Format("gemma4", read, grammar, start=START, end=END)
