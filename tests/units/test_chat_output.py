"""How the server reads a chat choice's output: reasoning, content, tool calls and finish_reason, whole and
streamed (the streamed deltas assembled equal the whole message)."""
from __future__ import annotations

import json

import pytest

from helpers.tool_calls import streamed
from kvlm.tool_calls.chat_output import ChatOutputSpec
from kvlm.tool_calls.formats import HERMES
from kvlm.tool_calls.reasoning import ReasoningParser

CALL = '<tool_call>\n{"name": "f", "arguments": {"city": "Zürich"}}\n</tool_call>'
TWO_CALLS = CALL + "\n" + CALL.replace('"f"', '"g"')


@pytest.mark.parametrize("spec, text, reason, content, calls, reasoning, finish", [
    (ChatOutputSpec(), "hello", "stop", "hello", [], None, "stop"),
    (ChatOutputSpec(tool_format=HERMES), "I will call.\n" + CALL, "stop", "I will call.\n", ["f"], None,
     "tool_calls"),
    (ChatOutputSpec(tool_format=HERMES), TWO_CALLS, "stop", None, ["f", "g"], None, "tool_calls"),
    (ChatOutputSpec(tool_format=HERMES, parallel=False), TWO_CALLS, "stop", None, ["f"], None, "tool_calls"),
    (ChatOutputSpec(tool_format=HERMES, named_tool=True), CALL, "stop", None, ["f"], None, "stop"),
    (ChatOutputSpec(tool_format=HERMES), CALL, "length", None, ["f"], None, "length"),
    (ChatOutputSpec(ReasoningParser(), HERMES), "<think>need weather</think>\n\n" + CALL, "stop", None, ["f"],
     "need weather", "tool_calls"),
    (ChatOutputSpec(ReasoningParser(starts_open=True)), "still thinking", "length", None, [], "still thinking",
     "length"),
    (ChatOutputSpec(ReasoningParser(), include_reasoning=False), "<think>x</think>answer", "stop", "answer", [],
     None, "stop"),
])
def test_message_and_stream_agree(spec, text, reason, content, calls, reasoning, finish):
    message, finish_reason = spec.message(text, reason)
    assert message["content"] == content and finish_reason == finish
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == calls
    assert message.get("reasoning_content") == reasoning
    for call in message.get("tool_calls", []):
        assert json.loads(call["function"]["arguments"]) == {"city": "Zürich"}
        assert "Zürich" in call["function"]["arguments"]  # not \\u-escaped
    whole = {"content": content or "", "reasoning_content": reasoning or "",
             "tool_calls": [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]}
    got, stream_finish = streamed(spec, text, reason)
    assert got["content"] == whole["content"] and got["reasoning_content"] == whole["reasoning_content"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(got["tool_calls"].items())] == whole["tool_calls"]
    assert stream_finish == finish
