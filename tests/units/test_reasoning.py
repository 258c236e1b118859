"""Reasoning output: `<think>...</think>` split into reasoning and content, whole and streamed; which prompts
start inside reasoning or have none; and where the content starts, for the engine's constraints."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlm.tool_calls.reasoning import QWEN35_CALL, ReasoningParser, ReasoningStream, reasoning_for_template

QWEN3 = ReasoningParser()
R1 = ReasoningParser(starts_open=True)
QWEN35 = ReasoningParser(starts_open=True, call_opening=QWEN35_CALL)  # a call opened in the think block ends it
THINKING_TEMPLATE = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                     "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
CALL = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("parser, text, expected", [
    (QWEN3, "<think>\nTwo and two.\n</think>\n\nIt is 4.", ("Two and two.", "It is 4.")),
    (QWEN3, "\n<think>x</think>", ("x", None)),
    (QWEN3, "<think>\n\n</think>\n\nHi", (None, "Hi")),
    (QWEN3, "<think>\nStill thinking when cut", ("Still thinking when cut", None)),
    (QWEN3, "<think>almost done </thi", ("almost done </thi", None)),
    (QWEN3, "No reasoning here, </think> is text.", (None, "No reasoning here, </think> is text.")),
    (QWEN3, "  ", (None, None)),
    (QWEN3, "<thi", (None, "<thi")),
    (R1, " <thi", ("<thi", None)),
    (R1, "Two and two.\n</think>\n\nIt is 4.", ("Two and two.", "It is 4.")),
    (R1, "<think>\nRepeated opening.</think>Yes", ("Repeated opening.", "Yes")),
    (R1, "Cut off", ("Cut off", None)),
    (R1, "a</think>b</think>c", ("a", "b</think>c")),
    (R1, "Look it up.\n\n" + CALL, ("Look it up.\n\n" + CALL, None)),  # not in other formats
    # vLLM's Qwen3 reasoning parser: <tool_call>, then (after whitespace) <function= or <function followed by
    # whitespace, ends the reasoning; a <tool_call> without it does not
    (QWEN35, "Look it up.\n\n" + CALL, ("Look it up.", CALL)),
    (QWEN35, CALL, (None, CALL)),
    (QWEN35, 'Look.<tool_call> <function name="f">', ("Look.", '<tool_call> <function name="f">')),
    (QWEN35, "Write <tool_call> then.\n</think>\n\nOK", ("Write <tool_call> then.", "OK")),
    (QWEN35, "a <tool_call>x\n" + CALL, ("a <tool_call>x", CALL)),  # the first call that opens
    (QWEN35, "a\n</think>\n\nb\n" + CALL, ("a", "b\n" + CALL)),
    (QWEN35, "a\n" + CALL + "</think>b", ("a", CALL + "</think>b")),  # the first of the two ends it
    (QWEN35, "Cut <tool_call>\n<function", ("Cut <tool_call>\n<function", None)),
    (QWEN35, "Cut <tool_call>\n<functions", ("Cut <tool_call>\n<functions", None)),
    (ReasoningParser(call_opening=QWEN35_CALL), "<think>a\n" + CALL, ("a", CALL)),
    (ReasoningParser(call_opening=QWEN35_CALL), "a\n" + CALL, (None, "a\n" + CALL)),  # no reasoning at all
])
def test_split(parser, text, expected):
    assert parser.split(text) == expected


def test_reasoning_for_template():
    assert reasoning_for_template("{{ messages }}", "<|im_start|>assistant\n") is None
    assert reasoning_for_template(None, "x") is None
    assert reasoning_for_template(THINKING_TEMPLATE, "<|im_start|>assistant\n") == ReasoningParser()
    opened = reasoning_for_template(THINKING_TEMPLATE, "<|im_start|>assistant\n<think>\n")
    assert opened == ReasoningParser(starts_open=True)
    assert reasoning_for_template(THINKING_TEMPLATE, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    # templates writing calls as Qwen3-Coder's XML (Qwen3.5) end the reasoning at a call; hermes JSON ones do not
    xml = THINKING_TEMPLATE + "<tool_call>\n<function={{ tool_call.name }}>"
    assert reasoning_for_template(xml, "<|im_start|>assistant\n<think>\n") == QWEN35
    hermes = THINKING_TEMPLATE + '<tool_call>\n{"name": "{{ tool_call.name }}"}'
    assert reasoning_for_template(hermes, "<|im_start|>assistant\n<think>\n") == R1


@pytest.mark.parametrize("parser, text, expected", [
    (QWEN3, "", None), (QWEN3, "  <thi", None), (QWEN3, "<think>abc</thi", None),
    (QWEN3, "<think>abc</think>", len("<think>abc</think>")), (QWEN3, "<think>a</think>\n{", len("<think>a</think>")),
    (QWEN3, "{", 0), (QWEN3, " x", 0),
    (R1, "abc", None), (R1, "ab</think>c", len("ab</think>")),
    # the engine's constraint cannot take over a call begun in the think block: it never starts then
    (QWEN35, "a " + CALL, None), (QWEN35, "a " + CALL + "</think>{", None), (QWEN35, "a</think>{", len("a</think>")),
    (QWEN35, "a <tool_call> b</think>{", len("a <tool_call> b</think>")),
])
def test_reasoning_ended(parser, text, expected):
    assert parser.reasoning_ended(text) == expected


def stream(parser, pieces):
    reasoning_stream, text, reasoning, content = ReasoningStream(parser), "", "", ""
    for piece in pieces:
        text += piece
        delta = reasoning_stream.update(text)
        reasoning, content = reasoning + delta[0], content + delta[1]
    delta = reasoning_stream.finish(text)
    return reasoning + delta[0] or None, content + delta[1] or None


def test_stream_holds_back_a_possible_end_marker_and_trailing_whitespace():
    reasoning_stream = ReasoningStream(QWEN3)
    assert reasoning_stream.update("<thi") == ("", "")
    assert reasoning_stream.update("<think>\nStep one. ") == ("Step one.", "")
    assert reasoning_stream.update("<think>\nStep one. </th") == ("", "")
    assert reasoning_stream.update("<think>\nStep one. </think>\n\n") == ("", "")
    assert reasoning_stream.update("<think>\nStep one. </think>\n\nDone") == ("", "Done")


def test_stream_holds_back_a_possible_call_opening():
    reasoning_stream = ReasoningStream(QWEN35)
    assert reasoning_stream.update("Step.\n<tool_") == ("Step.", "")
    assert reasoning_stream.update("Step.\n<tool_call>\n<func") == ("", "")
    assert reasoning_stream.update("Step.\n<tool_call>\n<function=") == ("", "<tool_call>\n<function=")
    reasoning_stream = ReasoningStream(QWEN35)
    assert reasoning_stream.update("Step.\n<tool_call>\n<func") == ("Step.", "")
    assert reasoning_stream.update("Step.\n<tool_call>\nno") == ("\n<tool_call>\nno", "")  # not a call after all


texts = st.lists(st.sampled_from(["<think>", "</think>", "<th", "</", "\n", " ", "step", "é🙂", "ok.", "<tool_call>",
                                  "<tool_", "<function=f>", "<func", "tion", "="]), max_size=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=texts, cuts=st.lists(st.integers(0, 10**6), max_size=20), starts_open=st.booleans(),
       call_opening=st.sampled_from([None, QWEN35_CALL]))
def test_streamed_equals_split(parts, cuts, starts_open, call_opening):
    parser, text = ReasoningParser(starts_open=starts_open, call_opening=call_opening), "".join(parts)
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    assert stream(parser, [text[a:b] for a, b in zip(points, points[1:])]) == parser.split(text)
