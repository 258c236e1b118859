"""Reasoning output: `<think>...</think>` split into reasoning and content, whole and streamed; which prompts
start inside reasoning or have none; and where the content starts, for the engine's constraints."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlm.tool_calls.reasoning import ReasoningParser, ReasoningStream, reasoning_for_template

QWEN3 = ReasoningParser()
R1 = ReasoningParser(starts_open=True)
THINKING_TEMPLATE = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                     "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


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


@pytest.mark.parametrize("parser, text, expected", [
    (QWEN3, "", None), (QWEN3, "  <thi", None), (QWEN3, "<think>abc</thi", None),
    (QWEN3, "<think>abc</think>", len("<think>abc</think>")), (QWEN3, "<think>a</think>\n{", len("<think>a</think>")),
    (QWEN3, "{", 0), (QWEN3, " x", 0),
    (R1, "abc", None), (R1, "ab</think>c", len("ab</think>")),
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


texts = st.lists(st.sampled_from(["<think>", "</think>", "<th", "</", "\n", " ", "step", "é🙂", "ok."]), max_size=12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=texts, cuts=st.lists(st.integers(0, 10**6), max_size=20), starts_open=st.booleans())
def test_streamed_equals_split(parts, cuts, starts_open):
    parser, text = ReasoningParser(starts_open=starts_open), "".join(parts)
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    assert stream(parser, [text[a:b] for a, b in zip(points, points[1:])]) == parser.split(text)
