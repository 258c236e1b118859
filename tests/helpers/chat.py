"""Chat's shared pieces: messages with reasoning, tool calls and their results (Qwen3.5's tests' and Gemma 4's), both
renderers called alike (transformers' as the reference, kvlm's), a scripted output written for a served model, and a
Qwen3-style template whose generation prompt carries an empty think block when thinking is off."""
from __future__ import annotations

import copy

# The tail is Qwen3's chat template word for word.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)
NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

USER = {"role": "user", "content": "Écris un haïku sur la mer. 🌊"}
ASK = {"role": "user", "content": "What is the weather in Zürich for the next two days?"}
ARGUMENTS = {"city": "Zürich", "days": 2, "threshold": 21.5, "options": {"unit": "celsius", "hourly": False},
             "fields": ["wind", "rain"]}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
TIME_CALL = {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": {"zone": "Europe/Zurich"}}}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "sunny <b>&</b>"}'}
TOOL_TURNS = [
    ASK,
    # content None, as OpenAI clients send it: transformers drops None values, and so must kvlm
    {"role": "assistant", "content": None, "reasoning_content": "I need the forecast.", "tool_calls": [CALL]},
    RESULT,
]

MODEL = "qwen35-test"
N_CTX = 2048  # the tools system message is over a thousand byte-level tokens


def reference(hf_tokenizer, template, messages, add_generation_prompt, tools=None, **kwargs) -> str:
    # deep copies: neither renderer may see the other's edits (both add reasoning aliases to their own copies)
    return hf_tokenizer.apply_chat_template(
        copy.deepcopy(messages), tools=copy.deepcopy(tools), chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt, **kwargs)


def render(tokenizer, messages, add_generation_prompt, tools=None, **kwargs) -> str:
    return tokenizer.apply_chat_template(copy.deepcopy(messages), add_generation_prompt, copy.deepcopy(tools),
                                         **kwargs)


def write(script: dict, model, text: str) -> None:
    script["ids"] = model.tokenizer.encode(text, add_special_tokens=False)
