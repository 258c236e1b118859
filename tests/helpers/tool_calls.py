"""Tool calls' shared pieces: a chat choice's output streamed and assembled, a call in Qwen3's XML form, and the
streaming check every format's tests run (the deltas of an output cut anywhere assemble to the finished parse and
follow OpenAI's rules), with the hypothesis strategies for names and arguments."""
from __future__ import annotations

import keyword

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvlm.tool_calls.chat_output import ChatOutputSpec, ChoiceStream
from kvlm.tool_calls.streaming import ContentDelta, ToolCallDelta, stream_parse

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = (st.none() | st.booleans() | st.integers(-10**20, 10**20)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True).filter(lambda name: not keyword.iskeyword(name))
arguments = st.dictionaries(names, json_values, max_size=4)


def without_ids(parsed):
    return parsed.content, [(call.name, call.arguments) for call in parsed.calls]


def split(text, cuts):
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def check_stream(fmt, text, cuts, tools=()):
    """The stream of `text` in pieces assembles to the finished parse, and its deltas follow OpenAI's rules."""
    assembled, deltas = stream_parse(fmt, split(text, cuts), tools)
    assert without_ids(assembled) == without_ids(fmt.parse(text, tools))
    check_deltas(deltas)
    return assembled


def check_deltas(deltas):
    heads = [delta for delta in deltas if isinstance(delta, ToolCallDelta) and delta.id is not None]
    assert [delta.index for delta in heads] == list(range(len(heads)))  # one head per call, in order
    assert len({delta.id for delta in heads}) == len(heads)
    assert all(delta.name for delta in heads)
    for delta in deltas:
        if isinstance(delta, ToolCallDelta) and delta.id is None:
            assert delta.name is None and delta.arguments and delta.index < len(heads)
        if isinstance(delta, ContentDelta):
            assert delta.text


def streamed(spec: ChatOutputSpec, text: str, finish_reason: str, piece: int = 3) -> tuple[dict, str]:
    stream, message = ChoiceStream(spec), {"content": "", "reasoning_content": "", "tool_calls": {}}
    deltas = [d for i in range(0, len(text), piece) for d in stream.deltas(text[i:i + piece])]
    for delta in deltas + stream.last_deltas():
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", []):
            entry = message["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call["function"].get("name") or entry["name"]
            entry["arguments"] += call["function"]["arguments"]
    assert deltas[0]["role"] == "assistant"
    return message, stream.finish_reason(finish_reason)


def xml_call(name, **params):
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"
