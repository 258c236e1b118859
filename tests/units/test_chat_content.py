"""A chat message's content on its way to the template: text parts as the template takes content (vLLM's content
formats, read from the template), and media parts refused by name (kvlm reads text only)."""
from __future__ import annotations

import pydantic
import pytest

from kvlm.server.errors import _validation_message
from kvlm.server.protocol import ChatCompletionRequest, ChatMessage
from kvlm.text.tokenizer import _content_format


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'eq', 'text') %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),
])
def test_the_content_format_is_read_from_the_template(template, expected):
    assert _content_format(template) == expected


@pytest.mark.parametrize("content_format, expected", [
    ("string", "Describe \nthis picture."),  # vLLM joins text parts by newlines for a template of strings
    ("openai", [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this picture."}]),
])
def test_text_parts_reach_the_template_in_its_content_format(content_format, expected):
    message = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                                      {"type": "text", "text": "this picture."}]})
    assert message.as_template_message(content_format)["content"] == expected


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_an_image_or_audio_part_is_refused_by_name(part):
    """kvlm runs a multimodal model's language model only: a request with media parts is refused, naming the part."""
    with pytest.raises(pydantic.ValidationError) as refused:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, part]}]})
    message, param = _validation_message(refused.value.errors()[0])
    assert f"content part type {part['type']!r} is not supported: kvlm reads text parts only" in message
    assert param.startswith("messages")
