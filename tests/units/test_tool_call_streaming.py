"""Streamed tool calls: the deltas of an output split at any points assemble to exactly what the finished
parse gives, for every format; ids and names go out once; possible markers are held back; what was sent is
never contradicted."""
from __future__ import annotations

import json

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from helpers.tool_calls import SETTINGS, arguments, check_deltas, check_stream, json_scalars, names, split, without_ids
from kvlm.tool_calls.formats import FORMATS, HERMES, LLAMA3_JSON, QWEN3_XML
from kvlm.tool_calls.streaming import ContentDelta, ToolCallDelta, ToolCallStream, assemble, stream_parse

contents = st.text(max_size=30) | st.sampled_from(["Let me check.\n", "  ", "Sure < not a tag <tool", "Dа 🙂\n"])


def json_call(name, args, ascii_only, compact, key="arguments"):
    separators = (",", ":") if compact else (", ", ": ")
    return json.dumps({"name": name, key: args}, ensure_ascii=ascii_only, separators=separators)


def expected_arguments(args):
    return json.dumps(args, ensure_ascii=False)


@SETTINGS
@given(content=contents, calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3),
       ascii_only=st.booleans(), compact=st.booleans(), cuts=st.lists(st.integers(0, 10**6), max_size=40))
def test_hermes_stream_equals_parse(content, calls, ascii_only, compact, cuts):
    assume("<tool_call>" not in content)
    blocks = [f"<tool_call>\n{json_call(name, args, ascii_only, compact)}\n</tool_call>" for name, args in calls]
    text = content + "\n".join(blocks)
    assembled = check_stream(HERMES, text, cuts)
    assert [(call.name, call.arguments) for call in assembled.calls] == [
        (name, expected_arguments(args)) for name, args in calls]
    assert assembled.content == (content if content.strip() else None)


@SETTINGS
@given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3), tag=st.booleans(),
       ascii_only=st.booleans(), cuts=st.lists(st.integers(0, 10**6), max_size=40))
def test_llama3_json_stream_equals_parse(calls, tag, ascii_only, cuts):
    text = ("<|python_tag|>" if tag else "") + "; ".join(
        json_call(name, args, ascii_only, False, key="parameters") for name, args in calls)
    assembled = check_stream(LLAMA3_JSON, text, cuts)
    assert [(call.name, call.arguments) for call in assembled.calls] == [
        (name, expected_arguments(args)) for name, args in calls]


@SETTINGS
@given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3), as_list=st.booleans(),
       cuts=st.lists(st.integers(0, 10**6), max_size=40))
def test_json_fallback_stream_equals_parse(calls, as_list, cuts):
    objects = [json_call(name, args, False, False) for name, args in calls]
    text = "[" + ", ".join(objects) + "]" if as_list or len(calls) > 1 else objects[0]
    assembled = check_stream(FORMATS["json_fallback"], text, cuts)
    assert [call.arguments for call in assembled.calls] == [expected_arguments(args) for _, args in calls]


python_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


@SETTINGS
@given(content=contents, calls=st.lists(st.tuples(names, st.dictionaries(names, python_values, max_size=4)),
                                        min_size=1, max_size=3),
       wrapped=st.booleans(), cuts=st.lists(st.integers(0, 10**6), max_size=40))
def test_pythonic_and_lfm2_stream_equals_parse(content, calls, wrapped, cuts):
    listed = "[" + ", ".join(name + "(" + ", ".join(f"{key}={value!r}" for key, value in args.items()) + ")"
                             for name, args in calls) + "]"
    if wrapped:
        assume("<|tool_call_start|>" not in content)
        fmt, text = FORMATS["lfm2"], content + "<|tool_call_start|>" + listed + "<|tool_call_end|>"
    else:
        fmt, text = FORMATS["pythonic"], listed
    assembled = check_stream(fmt, text, cuts)
    assert [(call.name, call.arguments) for call in assembled.calls] == [
        (name, expected_arguments(args)) for name, args in calls]


XML_TYPES = {"integer": st.integers(-10**6, 10**6), "number": st.floats(-1e6, 1e6), "boolean": st.booleans(),
             "array": st.lists(json_scalars, max_size=3), "object": st.dictionaries(st.text(max_size=4), json_scalars,
                                                                                     max_size=2),
             "string": st.text(max_size=20).filter(
                 lambda text: "</parameter>" not in text and "</tool_call>" not in text
                 and not text.startswith("\n") and not text.endswith("\n"))}


@st.composite
def xml_calls(draw):
    """A tool with typed parameters, the arguments of a call with values of those types as read, and the call written
    as Qwen3-Coder writes it."""
    name = draw(names)
    kinds = draw(st.dictionaries(names, st.sampled_from(sorted(XML_TYPES)), min_size=0, max_size=4))
    args = {key: draw(XML_TYPES[kind]) for key, kind in kinds.items()}
    tool = {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {key: {"type": kind} for key, kind in kinds.items()}}}}
    body = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                   for key, value in args.items())
    # as vLLM reads a number: an integral one as an int ("2.0" is 2)
    read = {key: int(value) if kinds[key] == "number" and value.is_integer() else value for key, value in args.items()}
    return tool, read, f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@SETTINGS
@given(content=contents, calls=st.lists(xml_calls(), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 10**6), max_size=40))
def test_qwen3_xml_stream_equals_parse(content, calls, cuts):
    assume("<tool_call>" not in content)
    tools = [tool for tool, _, _ in calls]
    assume(len({tool["function"]["name"] for tool in tools}) == len(tools))
    text = content + "\n".join(block for _, _, block in calls)
    assembled = check_stream(QWEN3_XML, text, cuts, tools)
    assert [json.loads(call.arguments) for call in assembled.calls] == [args for _, args, _ in calls]
    assert [call.arguments for call in assembled.calls] == [expected_arguments(args) for _, args, _ in calls]


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "\n", " ", '{"name": "f"', '{"name": ', '"g"', ", ",
             '"arguments": ', '{"a": 1', "}", "]", "[", '"x', "\\u00e9", "hi", "<function=f>", "<parameter=a>",
             "</parameter>", "</function>", "<|python_tag|>", "; ", "f(", "a=1", ")", "<|tool_call_start|>",
             "<|tool_call_end|>"]


@SETTINGS
@given(name=st.sampled_from(sorted(FORMATS)), pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=25),
       cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_any_text_streams_without_contradicting_itself(name, pieces, cuts):
    """On arbitrary text the stream never breaks its own rules; when the finished parse keeps every call the
    stream announced, the stream assembles to the finished parse."""
    fmt, text = FORMATS[name], "".join(pieces)
    stream, deltas, so_far = ToolCallStream(fmt), [], ""
    for piece in split(text, cuts):
        so_far += piece
        deltas += stream.update(so_far)
    announced = assemble(deltas).calls
    deltas += stream.finish(text)
    check_deltas(deltas)
    final = fmt.parse(text)
    kept = len(announced) <= len(final.calls) and all(
        sent.name == call.name and call.arguments.startswith(sent.arguments)
        for sent, call in zip(announced, final.calls))
    if kept:
        assert without_ids(assemble(deltas)) == without_ids(final)


def test_a_possible_marker_is_held_back_and_released_when_it_is_not_one():
    stream = ToolCallStream(HERMES)
    assert stream.update("Look: <") == [ContentDelta("Look: ")]
    assert stream.update("Look: <tool_") == []
    assert stream.update("Look: <tool_x") == [ContentDelta("<tool_x")]
    assert stream.finish("Look: <tool_x") == []


def test_id_and_name_once_then_argument_fragments_in_order():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    stream = ToolCallStream(HERMES)
    assert stream.update('<tool_call>\n{"name": "get_wea') == []  # a name is sent only whole
    head = stream.update(text)
    assert len(head) == 1 and head[0].name == "get_weather" and head[0].arguments == '{"city": "Pa'
    assert head[0].id.startswith("call_")
    more = stream.update(text + 'ris", "days": 1')  # the number may go on: not sent yet
    assert more == [ToolCallDelta(0, arguments='ris", "days": ')]
    end = stream.finish(text + 'ris", "days": 12}}\n</tool_call>')
    assert end == [ToolCallDelta(0, arguments="12}")]
    assert stream.result().content is None
    assert [(call.id, call.name, call.arguments) for call in stream.result().calls] == [
        (head[0].id, "get_weather", '{"city": "Paris", "days": 12}')]
    assert head[0].to_openai() == {"index": 0, "id": head[0].id, "type": "function",
                                   "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}
    assert end[0].to_openai() == {"index": 0, "function": {"arguments": "12}"}}


def test_escapes_are_sent_only_whole():
    stream = ToolCallStream(HERMES)
    start = '<tool_call>\n{"name": "f", "arguments": {"s": "a'
    assert stream.update(start)[0].arguments == '{"s": "a'
    assert stream.update(start + "\\u00") == []
    assert stream.update(start + "\\u00e9\\ud83d") == [ToolCallDelta(0, arguments="é")]  # half a pair waits
    assert stream.update(start + "\\u00e9\\ud83d\\ude00") == [ToolCallDelta(0, arguments="😀")]


def test_whitespace_only_content_is_never_sent():
    text = '\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
    assembled, deltas = stream_parse(HERMES, list(text))
    assert assembled.content is None and not any(isinstance(delta, ContentDelta) for delta in deltas)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_whitespace_only_output_sends_nothing(name):
    assembled, deltas = stream_parse(FORMATS[name], [" ", "\n", "\t "])
    assert deltas == [] and assembled.content is None and FORMATS[name].parse(" \n\t ").content is None


def test_a_call_cut_off_by_max_tokens_keeps_what_was_sent():
    """The finished parse makes an unfinished block content. The stream announced the call already, so it
    keeps it, with the arguments it had; the finished content (the block's text) extends the content sent, so
    it is sent too."""
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    assembled, _ = stream_parse(HERMES, list(text))
    assert [(call.name, call.arguments) for call in assembled.calls] == [("f", '{"a": [1, ')]
    assert assembled.content == "Hi " + text[3:]
    assert HERMES.parse(text).content == text and HERMES.parse(text).calls == []


def test_prose_streams_as_content_in_whole_output_formats():
    assembled, deltas = stream_parse(LLAMA3_JSON, ["The ", "answer ", "is 4."])
    assert [delta.text for delta in deltas] == ["The ", "answer ", "is 4."]
    assert assembled.content == "The answer is 4." and assembled.calls == []
