"""The Responses and Messages requests read into chat messages: what each item or block becomes, and malformed
parts refused with the field named (a 400, never a 500)."""
from __future__ import annotations

import pytest

from kvlm.server.messages_protocol import MessagesRequest, chat_messages
from kvlm.server.protocol import BadRequest
from kvlm.server.responses_protocol import input_messages


def test_input_items_become_chat_messages():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Need it."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]
    assert input_messages(items) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]


@pytest.mark.parametrize("item, param", [
    ({"type": "reasoning", "summary": "thought"}, "input[0]"),
    ({"type": "reasoning", "content": [{"type": "reasoning_text", "text": None}]}, "input[0].content[0].text"),
    ({"role": "user", "content": [{"type": "input_text", "text": None}]}, "input[0].content[0].text"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input[0].content[0].type"),
    ({"type": "function_call", "name": "f"}, "input[0].call_id"),
    ({"type": "item_reference", "id": "x"}, "input[0].type"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
])
def test_malformed_input_items_are_refused_by_field(item, param):
    with pytest.raises(BadRequest) as caught:
        input_messages([item])
    assert caught.value.param.startswith(param) and caught.value.status == 400


def test_content_blocks_become_chat_messages():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need it.", "signature": ""},
                                                  {"type": "tool_use", "id": "t1", "name": "w", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                             {"type": "text", "text": "Thanks"}]}]
    assert chat_messages(messages) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need it.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "Thanks"}]


@pytest.mark.parametrize("content, param", [
    ([{"type": "thinking", "thinking": None}], "messages[0].content[0].thinking"),
    ([{"type": "image", "source": {}}], "messages[0].content[0].type"),
    ([{"type": "text", "text": None}], "messages[0].content[0].type"),
])
def test_malformed_blocks_are_refused_by_field(content, param):
    with pytest.raises(BadRequest) as caught:
        chat_messages([{"role": "assistant", "content": content}])
    assert caught.value.param == param


def test_thinking_is_off_unless_asked_for():
    def kwargs(**fields):
        request = MessagesRequest(model="m", max_tokens=5, messages=[{"role": "user", "content": "Hi"}], **fields)
        return request.chat_request().chat_template_kwargs

    assert kwargs() == {"enable_thinking": False}
    assert kwargs(thinking={"type": "enabled", "budget_tokens": 1024}) == {"enable_thinking": True}
    assert kwargs(thinking={"type": "adaptive"}) == {"enable_thinking": True}
    with pytest.raises(BadRequest, match="thinking.type must be one of"):
        kwargs(thinking={"type": "sometimes"})
