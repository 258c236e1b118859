"""JSON read as far as it goes, with the part of its re-serialization that is already certain.

Streamed arguments must be append-only: what was sent must be a prefix of the final
`json.dumps(value, ensure_ascii=False)`, whatever whitespace or escapes the model wrote. Read piece by piece,
each finished piece (a string's characters so far, a number once a delimiter follows it, a separator) has
one serialization, so the re-serialized prefix only grows. The same reader parses the whole text too, so the
streamed and the final arguments cannot disagree.

It reads strict JSON as `json.loads` does, except that it refuses duplicate keys (the last one would replace
a value already streamed) and NaN/Infinity. Values already whole are read by `json`'s C scanner under those
same rules; only the values still being written (the open path) are read here.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvlm.tool_calls.calls import Malformed

WHITESPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+.eE0-9]*")
_LONGEST_HELD = len("\\uXXX")  # an unfinished escape: the end of a string that may not decode yet
_LITERALS = {"true": True, "false": False, "null": None}


@dataclass
class Node:
    """A JSON value read so far: `text` is the certain prefix of its serialization (all of it when `done`)."""
    text: str = ""
    done: bool = False
    value: Any = None
    members: dict[str, Node] = field(default_factory=dict)  # an object's, in order; the last may be unfinished


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def read_value(text: str, pos: int) -> tuple[Node, int]:
    """The value starting at `pos` (after optional whitespace) and where it ends; Malformed if it cannot be JSON."""
    pos = skip_whitespace(text, pos)
    if pos == len(text):
        return Node(), pos
    char = text[pos]
    if char in "{[":
        whole = _read_whole(text, pos)
        if whole is not None:
            return whole
    if char == "{":
        return _read_object(text, pos)
    if char == "[":
        return _read_array(text, pos)
    if char == '"':
        return _read_string(text, pos)
    if char == "-" or char.isdigit():
        return _read_number(text, pos)
    return _read_literal(text, pos)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) < len(pairs):
        raise ValueError("duplicate key")
    return found


def _no_constant(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_unique, parse_constant=_no_constant)


def _read_whole(text: str, pos: int) -> tuple[Node, int] | None:
    """An array or object at `pos` that is complete, read fast; None when it is not (or is not JSON)."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return None
    members = ({key: Node(json.dumps(item, ensure_ascii=False), True, item) for key, item in value.items()}
               if isinstance(value, dict) else {})
    return Node(json.dumps(value, ensure_ascii=False), True, value, members), end


def _read_object(text: str, pos: int) -> tuple[Node, int]:
    node = Node("{")
    pos = skip_whitespace(text, pos + 1)
    if text.startswith("}", pos):
        return Node("{}", True, {}), pos + 1
    while pos < len(text):
        if text[pos] != '"':
            raise Malformed(f"expected a key at {pos}")
        key, pos = _read_string(text, pos)
        node.text += key.text
        if not key.done:
            return node, pos
        if key.value in node.members:
            raise Malformed(f"duplicate key {key.value!r}")
        pos = skip_whitespace(text, pos)
        if pos == len(text):
            return node, pos
        if text[pos] != ":":
            raise Malformed(f"expected ':' at {pos}")
        node.text += ": "
        value, pos = read_value(text, pos + 1)
        node.members[key.value] = value
        node.text += value.text
        if not value.done:
            return node, pos
        pos = skip_whitespace(text, pos)
        if pos == len(text):
            return node, pos
        if text[pos] == "}":
            node.text += "}"
            node.done, node.value = True, {name: member.value for name, member in node.members.items()}
            return node, pos + 1
        if text[pos] != ",":
            raise Malformed(f"expected ',' or '}}' at {pos}")
        node.text += ", "
        pos = skip_whitespace(text, pos + 1)
    return node, pos


def _read_array(text: str, pos: int) -> tuple[Node, int]:
    node, items = Node("["), []
    pos = skip_whitespace(text, pos + 1)
    if text.startswith("]", pos):
        return Node("[]", True, []), pos + 1
    while True:
        item, pos = read_value(text, pos)
        node.text += item.text
        if not item.done:
            return node, pos
        items.append(item.value)
        pos = skip_whitespace(text, pos)
        if pos == len(text):
            return node, pos
        if text[pos] == "]":
            node.text += "]"
            node.done, node.value = True, items
            return node, pos + 1
        if text[pos] != ",":
            raise Malformed(f"expected ',' or ']' at {pos}")
        node.text += ", "
        pos += 1


def _read_string(text: str, pos: int) -> tuple[Node, int]:
    """A string; unfinished, the longest start of it that decodes, less a trailing half of a surrogate pair.

    Cut at an escape boundary, a JSON string decodes to a prefix of the whole string's value; a cut inside an
    escape does not decode. So the longest decodable cut (at most an unfinished escape short of the end) is
    the certain prefix, but for a last high surrogate, which the next escape may pair with.
    """
    try:
        value, end = _DECODER.raw_decode(text, pos)
        return Node(json.dumps(value, ensure_ascii=False), True, value), end
    except ValueError:
        pass
    raw = text[pos + 1:]
    for cut in range(len(raw), max(len(raw) - _LONGEST_HELD, 0) - 1, -1):
        try:
            value = json.loads('"' + raw[:cut] + '"')
        except ValueError:
            continue
        if value and "\ud800" <= value[-1] <= "\udbff":
            value = value[:-1]
        return Node(json.dumps(value, ensure_ascii=False)[:-1]), len(text)
    raise Malformed(f"not a JSON string at {pos}")


def _read_number(text: str, pos: int) -> tuple[Node, int]:
    """A number counts once something follows it: until then more digits may come."""
    run = _NUMBER_CHARS.match(text, pos).group()
    end = pos + len(run)
    if end == len(text):
        return Node(), pos
    if not _NUMBER.fullmatch(run):
        raise Malformed(f"bad number {run!r}")
    try:
        value = json.loads(run)
    except ValueError as exc:  # an integer longer than Python converts
        raise Malformed(str(exc)) from None
    return Node(json.dumps(value), True, value), end


def _read_literal(text: str, pos: int) -> tuple[Node, int]:
    for word, value in _LITERALS.items():
        if text.startswith(word, pos):
            return Node(word, True, value), pos + len(word)
        if word.startswith(text[pos:]):
            return Node(), pos
    raise Malformed(f"unexpected {text[pos]!r} at {pos}")
