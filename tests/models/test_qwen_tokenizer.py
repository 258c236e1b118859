"""kvlm.text.tokenizer on the real Qwen2.5-Coder-0.5B-Instruct GGUF against transformers' tokenizer for the same file.

Qwen2's pre-tokenizer ("qwen2") cuts every numeral into single digits and keeps code indentation as whitespace
runs; its chat template adds a default system message and renders tools, tool calls and tool responses.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlm.loader.gguf_reader import read_gguf_metadata
from kvlm.text.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "",
    "def reverse(s: str) -> str:\n    \"\"\"Reverse s.\"\"\"\n    return s[::-1]\n\n\n"
    "class A:\n\tdef f(self):\n\t\tpass\n",
    "function add(a, b) {\n  if (a === undefined) {\n    return b;\n  }\n  return a + b; // sum\n}\n",
    "    const xs = [1, 2, 3].map((x) => x ** 2);\r\n    console.log(`${xs}`);\r\n",
    "日本語のテキスト，中文文本。한국어 텍스트",
    "简体中文：你好，世界！繁體中文：你好，世界！",
    "emoji 😀👍🏽🇫🇷 and ZWJ 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏾‍💻 🏴‍☠️",
    "a  b   c    d\t\te\t \tf",
    "\n\n\nthree newlines, then CRLF\r\n\r\nand trailing spaces   ",
    " \n \n  \t\n",
    "1234567 3.14159 1,000,000 -42 1e10 0x1F 2024-06-01",
    "I'm sure you're right, they've said we'll go, I'd say it's DON'T, We'Ll, YOU'RE",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|> spaced <|im_end|> tokens ",
    "<|im_start|without end <|im_end",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<|fim_prefix|>def f(<|fim_suffix|>):\n    pass<|fim_middle|>",
    "héllo wörld, ça va? naïve façade Ångström",
    "\u00a0non-breaking\u2003em space\u200bzero width",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Paris"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL_TURNS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}'},
]

CONVERSATIONS = {
    "user alone": ([{"role": "user", "content": "Write a Python function that reverses a string."}], None),
    "system": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}], None),
    "multi-turn": (
        [
            {"role": "system", "content": "You write code."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "def hello():\n    print('hi')"},
            {"role": "user", "content": "Now in JS, 日本語 comments 😀"},
        ],
        None,
    ),
    "tools": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL]),
    "tools and system": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}],
        [WEATHER_TOOL],
    ),
    "tool call and response": (TOOL_CALL_TURNS, [WEATHER_TOOL]),
}

PIECES = st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<|endoftext|>", " ", "    ", "\n", "\t", "\r\n", "123", " 4567", "'s", "'LL",
     "😀", "👨‍👩‍👧", "日本", "def ", "{}"]
)
RANDOM_TEXT = st.lists(st.one_of(st.text(max_size=16), PIECES), max_size=12).map("".join)


@pytest.fixture(scope="module")
def metadata(qwen_gguf_path) -> dict:
    return read_gguf_metadata(qwen_gguf_path)


@pytest.fixture(scope="module")
def tokenizer(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


def test_properties(tokenizer, metadata, hf_qwen_tokenizer):
    assert metadata["tokenizer.ggml.pre"] == "qwen2" and metadata["tokenizer.ggml.add_bos_token"] is False
    assert tokenizer.vocab_size == len(hf_qwen_tokenizer) == 151936
    assert (tokenizer.bos_id, tokenizer.eos_id) == (151643, 151645)
    assert tokenizer.eos_id == hf_qwen_tokenizer.eos_token_id
    # As llama.cpp: <|im_end|> (eos), <|endoftext|>, and the fill-in-the-middle ends <|fim_pad|>, <|repo_name|>,
    # <|file_sep|>.
    assert tokenizer.stop_ids == frozenset({151645, 151643, 151662, 151663, 151664})


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_qwen_tokenizer, text):
    assert tokenizer.encode(text) == hf_qwen_tokenizer.encode(text)


@settings(max_examples=200, deadline=None)
@given(text=RANDOM_TEXT)
def test_encode_matches_transformers_on_random_text(tokenizer, hf_qwen_tokenizer, text):
    assert tokenizer.encode(text) == hf_qwen_tokenizer.encode(text)


def test_numerals_are_single_digits_and_no_bos_is_added(tokenizer):
    assert len(tokenizer.encode("1234567")) == 7
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)


def test_special_tokens_in_text_are_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>") == [151644, 872, 198, 6023, 151645, 151643]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers_and_round_trips(tokenizer, hf_qwen_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    for skip in (False, True):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_qwen_tokenizer.decode(
            ids, skip_special_tokens=skip)


@settings(max_examples=100, deadline=None)
@given(text=RANDOM_TEXT)
def test_decode_and_stream_round_trip_on_random_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    decoder = StreamDecoder(tokenizer)
    assert "".join([*(decoder.feed(i) for i in ids), decoder.flush()]) == text


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_qwen_tokenizer, name, add_generation_prompt):
    messages, tools = CONVERSATIONS[name]
    expected = hf_qwen_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools) == expected
    assert tokenizer.encode_chat(messages, add_generation_prompt, tools) == hf_qwen_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, tools=tools, return_dict=False)


def test_chat_template_renders_the_default_system_message_and_tools(tokenizer):
    alone = tokenizer.apply_chat_template(CONVERSATIONS["user alone"][0])
    assert alone.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert alone.endswith("<|im_start|>assistant\n")
    with_tools = tokenizer.apply_chat_template(TOOL_CALL_TURNS, tools=[WEATHER_TOOL])
    assert '"name": "get_weather"' in with_tools and "<tools>" in with_tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in with_tools
    assert "<|im_start|>user\n<tool_response>\n" in with_tools


def test_a_tool_that_is_not_a_schema_is_named(tokenizer):
    with pytest.raises(ValueError, match="JSON schema.*'get_weather'"):
        tokenizer.apply_chat_template(CONVERSATIONS["user alone"][0], tools=["get_weather"])
