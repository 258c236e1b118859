"""Qwen3-Coder and Qwen3.5 calls, in XML: one block per call,
`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n</tool_call>`.

Values are bare text, so their JSON type comes from the tool's parameters schema: a parameter declared
integer, number, boolean, object, array or null is read as that type, as vLLM's qwen3_coder parser reads it (see
`convert`; text that does not read as one of the declared types stays a string); any other is the text itself,
less the newline after `<parameter=KEY>` and the one before `</parameter>`. Text values stream as they come; typed
ones when they end.
"""
from __future__ import annotations

import json
import math
from collections.abc import Collection
from typing import Any

from kvlm.tool_calls.calls import Malformed, PartialCall
from kvlm.tool_calls.format import BlockFormat, Tools, held_back
from kvlm.tool_calls.grammar import alternatives, json_rule, literal, marker, one_or_more, parameters_schema
from kvlm.tool_calls.partial_json import skip_whitespace

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_END = "\n" + PARAMETER_END + "\n"  # after a value, in the template's layout
_TYPED = frozenset({"integer", "number", "boolean", "object", "array", "null"})
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


def declared_types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind or ())


def is_text(schema: dict[str, Any]) -> bool:
    """A parameter written as bare text: one not declared of any JSON type but string."""
    return not declared_types(schema) & _TYPED


def convert(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as the JSON type its schema declares; the text itself when it is not one.

    vLLM's rules (Qwen3CoderToolParser._convert_param_value, vllm/tool_parsers/qwen3coder_tool_parser.py at
    vllm-project/vllm 00d0a333ba9b8e40eb35fc0b54b4ae96114f30b3), which also read the Python literals Qwen3.5's
    template writes past arguments with (`| string`: True, False, None):
    - "null" or "None", in any case, is null when the schema allows null or declares no string type;
    - integer: Python's int() of the text ("07" is 7, "3.0" is no integer);
    - number: float(), then an int when integral ("3.0" is 3, "21.5" stays 21.5; so past 2**53 an integer is
      rounded, as in vLLM); kvlm keeps inf and nan as text (no JSON number; vLLM keeps nan as text, and fails on inf);
    - boolean: "true" or "false" in any case ("True" is true). Where vLLM reads any other text as false, kvlm keeps
      it as text, as it does for the other types;
    - object, array (and a JSON-quoted string, as a forcing grammar writes it): JSON of that type (where JSON fails,
      vLLM also tries ast.literal_eval; kvlm does not: the template writes objects and arrays as JSON).
    A union of types (kvlm's rule: vLLM reads a parameter with a list of types by ast.literal_eval) takes the
    first of these types, in this order, that the text reads as.
    """
    if is_text(schema):
        return value
    types = declared_types(schema)
    if value.lower() in ("null", "none") and ("null" in types or "string" not in types):
        return None
    for kind in _READ_ORDER:
        if kind in types and (read := _read_as(kind, value)) is not _NOT_READ:
            return read
    return value


_READ_ORDER = ("integer", "number", "boolean", "object", "array", "string")
_NOT_READ = object()


def _read_as(kind: str, value: str) -> Any:
    """`value` read as the JSON type `kind` by the rules above; _NOT_READ when it is not one."""
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            return _NOT_READ
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            return _NOT_READ
        if not math.isfinite(number):
            return _NOT_READ
        return int(number) if number.is_integer() else number
    if kind == "boolean":
        lowered = value.lower()
        return lowered == "true" if lowered in ("true", "false") else _NOT_READ
    try:
        parsed = json.loads(value)
    except ValueError:
        return _NOT_READ
    return parsed if _JSON_TYPES.get(type(parsed)) == kind else _NOT_READ


def _name(body: str, pos: int) -> tuple[str | None, int]:
    """The name of a `<function=` or `<parameter=` tag whose `=` ends at `pos` (None while cut short)."""
    close = body.find(">", pos)
    name = body[pos:] if close < 0 else body[pos:close]
    if "\n" in name or "<" in name or (close >= 0 and not name):
        raise Malformed(f"bad tag name {name!r}")
    return (None, pos) if close < 0 else (name, close + 1)


def _startswith(body: str, pos: int, tag: str) -> bool | None:
    """Whether `tag` is at `pos`; None while the body ends inside it."""
    rest = body[pos:pos + len(tag)]
    if rest == tag:
        return True
    return None if tag.startswith(rest) and pos + len(rest) == len(body) else False


def read(body: str, tools: Tools) -> tuple[list[PartialCall], bool]:
    pos = skip_whitespace(body, 0)
    opened = _startswith(body, pos, FUNCTION)
    if opened is False:
        raise Malformed("a call block without <function=")
    name, pos = _name(body, pos + len(FUNCTION)) if opened else (None, pos)
    if name is None:
        return [PartialCall(None)], False
    properties = parameters_schema(tools, name).get("properties") or {}
    arguments, seen = "{", set()
    while (pos := skip_whitespace(body, pos)) < len(body):
        if _startswith(body, pos, FUNCTION_END):
            if skip_whitespace(body, pos + len(FUNCTION_END)) < len(body):
                raise Malformed("text after </function>")
            return [PartialCall(name, arguments + "}")], True
        parameter = _startswith(body, pos, PARAMETER)
        if parameter is False and _startswith(body, pos, FUNCTION_END) is False:
            raise Malformed(f"expected a parameter at {pos}")
        key, pos = _name(body, pos + len(PARAMETER)) if parameter else (None, pos)
        if key is None:
            break
        if key in seen:
            raise Malformed(f"parameter {key!r} given twice")
        seen.add(key)
        arguments += (", " if len(seen) > 1 else "") + json.dumps(key, ensure_ascii=False) + ": "
        end = body.find(PARAMETER_END, pos)
        schema = properties.get(key) or {}
        if end < 0:
            arguments += _partial_value(body[pos:], schema)
            break
        arguments += json.dumps(convert(_strip_newlines(body[pos:end]), schema), ensure_ascii=False)
        pos = end + len(PARAMETER_END)
    return [PartialCall(name, arguments)], False


def _strip_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _partial_value(raw: str, schema: dict[str, Any]) -> str:
    """The certain start of an unfinished value's JSON: a text value's characters so far, a typed value nothing."""
    if not is_text(schema):
        return ""
    raw = raw[:len(raw) - max(held_back(raw, "\n" + PARAMETER_END), held_back(raw, PARAMETER_END))]
    return json.dumps(raw[1:] if raw.startswith("\n") else raw, ensure_ascii=False)[:-1]


def grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
            special_tokens: Collection[str] | None) -> str:
    """Parameters in schema order, the required ones present; a function without declared properties takes
    any parameters, as text."""
    newline, tag_end = literal("\n"), literal(">\n")
    names = [f"function_{i}" for i in range(len(functions))]
    rules = [f"start: {one_or_more('call', newline, parallel)}",
             f"call: {marker(START, special_tokens)} {newline} ({alternatives(names)}) {newline} "
             f"{marker(END, special_tokens)}",
             f"text_value[suffix={literal(VALUE_END)}]: /(.|\\n)*/",
             f"any_parameter: {literal(PARAMETER)} /[^<>\\n]+/ {tag_end} text_value"]
    for i, (rule, (name, parameters)) in enumerate(zip(names, functions)):
        properties = parameters.get("properties")
        required = set(parameters.get("required") or ())
        if properties is None:
            body = "any_parameter*"
        else:
            keys = [f"parameter_{i}_{j}" for j in range(len(properties))]
            body = " ".join(key if prop in required else f"{key}?" for key, prop in zip(keys, properties))
            rules += [_parameter_rule(key, prop, schema, parameters) for key, (prop, schema)
                      in zip(keys, properties.items())]
        rules.append(f"{rule}: {literal(FUNCTION + name)} {tag_end} {body} {literal(FUNCTION_END)}")
    return "\n".join(rules) + "\n"


def _parameter_rule(rule: str, key: str, schema: dict[str, Any], parameters: dict[str, Any]) -> str:
    """A parameter: free text up to `</parameter>` (one of its enum when it has one), else JSON of its schema."""
    head = literal(PARAMETER + key + ">\n")
    if is_text(schema):
        enum = schema.get("enum")
        if enum and all(isinstance(choice, str) for choice in enum):
            return f"{rule}: {head} ({alternatives([literal(choice) for choice in enum])}) {literal(VALUE_END)}"
        return f"{rule}: {head} text_value"
    definitions = {word: parameters[word] for word in ("$defs", "definitions") if word in parameters}
    return f"{rule}: {head} {json_rule({**schema, **definitions})} {literal(VALUE_END)}"


FORMAT = BlockFormat("qwen3_xml", read, grammar, start=START, end=END)
