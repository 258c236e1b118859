"""Qwen3.5's chat template through kvlm: `<think>` reasoning and XML tool calls.

Rendering: kvlm renders Qwen3.5's own template exactly as transformers does (`PreTrainedTokenizerFast.
apply_chat_template(..., tokenize=False)` given the same template string; no expected prompt is written by hand),
from GGUF metadata, from a folder's chat_template.jinja, and from an OpenAI-style request.

Parsing: kvlm reads the template's tool-call form as QWEN3_XML and the `<think>` the generation prompt opens, and
turns outputs written as Qwen3.5 writes them into OpenAI's message shape. The expectations are what vLLM's parsers
for these models give (`--reasoning-parser qwen3 --tool-call-parser qwen3_coder`: vllm/reasoning/
qwen3_reasoning_parser.py and vllm/tool_parsers/qwen3coder_tool_parser.py), written out per case as vLLM returns
them, then put through kvlm's documented normalisation (kvlm/tool_calls/reasoning.py, calls.py): reasoning without
its surrounding whitespace, content without its leading whitespace, whitespace-only content as null. This includes
the two rules vLLM has for Qwen3.5 in particular: a tool call opened inside the think block ends the reasoning, and
parameter values written as Python literals (True, False, None) read as JSON ones.

Then one end-to-end chat completion with tools through the server, on a tiny random Llama whose vocabulary has
Qwen3.5's chat tokens and whose GGUF metadata carries the template; its output is scripted (as in
test_harmony_server.py), since a random model writes no tool calls.

Provenance of tests/data/qwen35-chat-template.jinja (7756 bytes, no final newline, SHA-256 below):
- Byte for byte the Python string literal `_QWEN_CHAT_TEMPLATE` ("Chat template extracted from Qwen/Qwen3.5-27B
  tokenizer_config.json") in anhvth/llm-loadbalancer, src/llm_loadbalancer/tools/convert_to_sft_data.py, at commit
  82b5190ea32b3305400daa7a629544d23df42e1b (the literal last changed by 5051f4bc28c987089b7743b3f2a63d02e00169e4).
- The same template as huggingface/huggingface.js packages/jinja/test/e2e.test.js carries it for "Qwen/Qwen3.5-4B"
  (added by f9f7b300148c47cae88b119f62ec8ad94636a137, unchanged at fe42e68017ffc76d09922ea8f9b38a6964345710), where
  the `\\n` escapes inside the Jinja string literals were decoded to newlines; re-escaping them gives these bytes.
- The SHA-256 is the one public repositories pin for the chat_template.jinja of Qwen/Qwen3.5-27B (at
  feea018b31f89dc0950e61da42577a7a4ab09169), of Qwen/Qwen3.5-4B (at 851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a) and
  of mlx-community/Qwen3.5-35B-A3B-4bit (a copy of Qwen/Qwen3.5-35B-A3B's).
- vllm-project/vllm's rust/src/chat/tests/templates/qwen35.jinja (commit 263eecffce9392ceba860c6f3ee96179737ab01b;
  the test constant that reads it is QWEN3_5_0_8B_TEMPLATE) is this template but for its generation prompt, which
  opens a think block only when enable_thinking is true (thinking off by default), and a final newline.
  SMALL_TEMPLATE below is derived from ours by that one change; its SHA-256 starts with the 24 hex digits a public
  audit reports for vLLM's file (ad22cb6365e58696ffc10f1f..., 7756 bytes).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json

import jinja2
import pytest
from helpers import DATA
from helpers.chat import (
    ARGUMENTS, ASK, CALL, MODEL, N_CTX, RESULT, TIME, TIME_CALL, TOOL_TURNS, USER, reference, render, write,
)
from helpers.gguf_factory import (
    SPECIAL_TOKENS, byte_level_tokenizer, byte_level_vocab, gguf_metadata, gguf_tensors, llama_config, random_llama,
    template_folder_tokenizers, write_gguf,
)
from helpers.tool_calls import streamed, xml_call

from kvlm.loader.load import load_model
from kvlm.server.chat_turn import chat_prompt
from kvlm.server.protocol import ChatCompletionRequest
from kvlm.text.tokenizer import Tokenizer
from kvlm.tool_calls.chat_output import ChatOutputSpec, ChoiceStream
from kvlm.tool_calls.formats import QWEN3_XML, format_for_template
from kvlm.tool_calls.reasoning import QWEN35_CALL, ReasoningParser, reasoning_for_template
from kvlm.tool_calls.tool_choice import plan_tools

TEMPLATE_PATH = DATA / "qwen35-chat-template.jinja"
TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
# read_bytes + decode, not read_text: universal newlines would hide a stray \r
TEMPLATE = TEMPLATE_PATH.read_bytes().decode("utf-8")

_THINKING_BY_DEFAULT = (
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif %}")
_THINKING_ON_REQUEST = (
    "    {%- if enable_thinking is defined and enable_thinking is true %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}")
SMALL_TEMPLATE = TEMPLATE.replace(_THINKING_BY_DEFAULT, _THINKING_ON_REQUEST) + "\n"  # vLLM's Qwen3.5-0.8B fixture
SMALL_TEMPLATE_SHA256 = "ad22cb6365e58696ffc10f1fbfc5f09b8762d0486df899e8f18b0491906e0b21"
TEMPLATES = {"Qwen3.5": TEMPLATE, "Qwen3.5-0.8B": SMALL_TEMPLATE}

OPEN_THINK = "<|im_start|>assistant\n<think>\n"  # the generation prompt with thinking on
CLOSED_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # ... and off

# Parameters of every JSON type the XML form writes as bare text, read back by the schema's types.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather and forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Zürich"},
        "days": {"type": "integer"},
        "threshold": {"type": "number"},
        "options": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                                     "hourly": {"type": "boolean"}}},
        "fields": {"type": "array", "items": {"type": "string"}},
        "hourly": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
    }, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]

# name: (messages, add_generation_prompt, tools, template kwargs)
CONVERSATIONS = {
    "user only": ([USER], True, None, {}),
    "user only, no generation prompt": ([USER], False, None, {}),
    "enable_thinking false": ([USER], True, None, {"enable_thinking": False}),
    "enable_thinking true": ([USER], True, None, {"enable_thinking": True}),
    "system and user": ([{"role": "system", "content": "  Answer in French.\n"}, USER], True, None, {}),
    "system as text parts": ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                              {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], True, None, {}),
    # Before the last user query an assistant turn is written without its think block; after it, with one.
    "multi-turn": ([
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "  Add again.\n"},
    ], False, None, {}),
    "reasoning inline in the content": ([
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"},
    ], False, None, {}),
    "reasoning under vLLM's name": ([
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4", "reasoning": "Add."},
    ], False, None, {}),
    "tools, system merged into their block": ([{"role": "system", "content": "Use tools."}, ASK], True, TOOLS, {}),
    "reasoning, a call with dict arguments, its result": (TOOL_TURNS, True, TOOLS, {}),
    "content and two calls, two results, the answer": ([
        ASK,
        {"role": "assistant", "content": "Let me check both.", "reasoning_content": "Two tools.",
         "tool_calls": [CALL, TIME_CALL]},
        RESULT,
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "assistant", "content": "Sunny, 21 °C, and it is 14:05.", "reasoning_content": "Both came back."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ], True, TOOLS, {"enable_thinking": False}),
    # The template writes non-string values with `| string`: Python's True and None, not JSON's.
    "arguments with a boolean and a null": ([
        ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Oslo", "hourly": True, "note": None}}}]},
    ], False, TOOLS, {}),
}
# The template's raise_exception checks and the errors a bad message makes, which must fail the same way in both.
REFUSED = {
    "system message not first": [USER, {"role": "system", "content": "Late."}],
    "no user query": [{"role": "system", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    "tool results only": [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}],
    "unknown role": [USER, {"role": "critic", "content": "No."}],
    "arguments as a JSON string": [ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}],
}


@pytest.fixture(scope="module")
def reference_tokenizer():
    """transformers' renderer; the vocabulary does not matter to the text it renders."""
    return byte_level_tokenizer(1000)


# --- a tiny Qwen3.5-like vocabulary: the byte-level one, then Qwen3.5's chat tokens --------------------------------

# As Qwen3.5's tokenizer.json has them: <|im_end|> special (a GGUF control token), the think and tool-call tags
# added but not special (user-defined), so they stay in the output text.
CHAT_TOKENS = ("<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")
BYTE_LEVEL_SIZE = 1000
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types


def qwen35_metadata(template: str = TEMPLATE, config=None) -> dict:
    config = config or llama_config(vocab_size=BYTE_LEVEL_SIZE + len(CHAT_TOKENS))
    config.max_position_embeddings = N_CTX
    tokens, merges = byte_level_vocab(BYTE_LEVEL_SIZE)
    tokens = [*tokens, *CHAT_TOKENS]
    control = {*SPECIAL_TOKENS, "<|im_end|>"}
    types = [_CONTROL if t in control else _USER_DEFINED if t in CHAT_TOKENS else _NORMAL for t in tokens]
    return {**gguf_metadata(config), "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
            "tokenizer.chat_template": template}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    """kvlm's tokenizers built from GGUF metadata carrying each template, as a file's metadata reaches them."""
    return {name: Tokenizer.from_gguf_metadata(qwen35_metadata(template)) for name, template in TEMPLATES.items()}


# --- the template --------------------------------------------------------------------------------------------------

def test_the_template_file_is_qwen35s():
    data = TEMPLATE_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == TEMPLATE_SHA256 and len(data) == 7756
    assert hashlib.sha256(SMALL_TEMPLATE.encode()).hexdigest() == SMALL_TEMPLATE_SHA256
    assert SMALL_TEMPLATE != TEMPLATE + "\n"  # the replacement took place
    # Qwen3.5's, not Qwen3's (JSON calls) nor Qwen3-Coder's (no <think>, tools written as XML)
    for marker in ("<function=", "<parameter=", "enable_thinking", "<think>", "render_content", "tool | tojson"):
        assert marker in TEMPLATE


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_renders_as_transformers(tokenizers, reference_tokenizer, variant, name):
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
    expected = reference(reference_tokenizer, TEMPLATES[variant], messages, add_generation_prompt, tools, **kwargs)
    assert render(tokenizers[variant], messages, add_generation_prompt, tools, **kwargs) == expected


def test_conversations_reach_the_branches_they_name(reference_tokenizer):
    """Guards the cases above against a template or input change that would make them test nothing."""
    def rendered(name, template=TEMPLATE):
        messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
        return reference(reference_tokenizer, template, messages, add_generation_prompt, tools, **kwargs)

    assert rendered("user only").endswith(OPEN_THINK)
    assert rendered("user only", SMALL_TEMPLATE).endswith(CLOSED_THINK)
    assert rendered("enable_thinking false").endswith(CLOSED_THINK)
    assert rendered("enable_thinking true", SMALL_TEMPLATE).endswith(OPEN_THINK)
    assert not rendered("user only, no generation prompt").endswith("assistant\n")
    assert rendered("system and user").startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    turns = rendered("multi-turn")
    assert "Simple sum." not in turns and turns.endswith("<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6"
                                                         "<|im_end|>\n")
    assert "<think>\nAdd.\n</think>\n\n4<|im_end|>" in rendered("reasoning inline in the content")
    assert "<think>\nAdd.\n</think>\n\n4<|im_end|>" in rendered("reasoning under vLLM's name")
    assert "</IMPORTANT>\n\nUse tools.<|im_end|>" in rendered("tools, system merged into their block")
    call = rendered("reasoning, a call with dict arguments, its result")
    assert ("<think>\nI need the forecast.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "Zürich\n</parameter>\n<parameter=days>\n2\n</parameter>\n") in call
    assert '<parameter=options>\n{"unit": "celsius", "hourly": false}\n</parameter>' in call
    assert "<|im_start|>user\n<tool_response>\n" + RESULT["content"] + "\n</tool_response><|im_end|>\n" in call
    two = rendered("content and two calls, two results, the answer")
    assert "Let me check both.\n\n<tool_call>\n<function=get_weather>" in two
    assert "</tool_call>\n<tool_call>\n<function=get_time>" in two and "Two tools." not in two
    assert "</tool_response>\n<tool_response>\n14:05\n</tool_response><|im_end|>" in two
    assert "<parameter=hourly>\nTrue\n</parameter>\n<parameter=note>\nNone\n</parameter>" in rendered(
        "arguments with a boolean and a null")


@pytest.mark.parametrize("name", REFUSED)
def test_refuses_as_transformers_does(tokenizers, reference_tokenizer, name):
    with pytest.raises(Exception) as theirs:
        reference(reference_tokenizer, TEMPLATE, REFUSED[name], True, TOOLS)
    with pytest.raises(Exception) as ours:
        render(tokenizers["Qwen3.5"], REFUSED[name], True, TOOLS)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    if name != "arguments as a JSON string":
        assert isinstance(ours.value, jinja2.TemplateError)


def test_a_folders_chat_template_jinja(tmp_path, reference_tokenizer):
    """Qwen3.5 ships its template as chat_template.jinja; kvlm and transformers each read the folder."""
    ours, from_folder = template_folder_tokenizers(tmp_path, TEMPLATE_PATH.read_bytes())
    assert ours.chat_template == from_folder.chat_template == TEMPLATE
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS["reasoning, a call with dict arguments, its result"]
    assert render(ours, messages, add_generation_prompt, tools, **kwargs) == from_folder.apply_chat_template(
        copy.deepcopy(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def openai_body(**extra) -> ChatCompletionRequest:
    """TOOL_TURNS as an OpenAI client sends them: arguments as a JSON string, content null, reasoning_content."""
    return ChatCompletionRequest.model_validate({
        "messages": [
            {"role": "developer", "content": "Use tools."},
            ASK,
            {"role": "assistant", "content": None, "reasoning_content": "I need the forecast.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps(ARGUMENTS, ensure_ascii=False)}}]},
            RESULT,
        ],
        "tools": TOOLS, **extra})


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_an_openai_request_renders_as_transformers_renders_its_messages(tokenizers, reference_tokenizer, kwargs):
    """The server's path: the request's turns give the prompt transformers makes of them written its way (arguments
    as an object, developer as system), with chat_template_kwargs reaching the template."""
    body = openai_body(**({"chat_template_kwargs": kwargs} if kwargs else {}))
    expected = reference(reference_tokenizer, TEMPLATE, [{"role": "system", "content": "Use tools."}, *TOOL_TURNS],
                         True, TOOLS, **kwargs)
    assert chat_prompt(tokenizers["Qwen3.5"], body, body.tool_dicts()) == expected
    assert expected.endswith(CLOSED_THINK if kwargs else OPEN_THINK)


# --- the format, and how outputs are read -----------------------------------------------------------------------

def test_the_template_shows_the_xml_format_and_think_blocks(tokenizers, variant):
    tokenizer = tokenizers[variant]
    assert format_for_template(tokenizer.chat_template) is QWEN3_XML
    plan = plan_tools(tokenizer.chat_template, TOOLS, "auto", True, lambda markers: markers)
    assert plan.format is QWEN3_XML and plan.forcing_grammar is None

    def reasoning(**kwargs):
        return reasoning_for_template(tokenizer.chat_template, render(tokenizer, [ASK], True, TOOLS, **kwargs))

    # The generation prompt opens the think block: the output starts inside the reasoning and writes only </think>,
    # or opens a tool call before it.
    opened = ReasoningParser(starts_open=True, call_opening=QWEN35_CALL)
    assert reasoning(enable_thinking=True) == opened
    assert reasoning(enable_thinking=False) is None  # an empty block closed in the prompt: all of it is content
    assert reasoning() == (opened if variant == "Qwen3.5" else None)


@functools.cache
def output_spec(enable_thinking: bool = True) -> ChatOutputSpec:
    """What the server reads a Qwen3.5 turn with: reasoning from the prompt, the format from the template."""
    tokenizer = Tokenizer.from_gguf_metadata(qwen35_metadata())
    prompt = render(tokenizer, [ASK], True, TOOLS, enable_thinking=enable_thinking)
    plan = plan_tools(TEMPLATE, TOOLS, "auto", True, lambda markers: markers)
    return ChatOutputSpec(reasoning_for_template(TEMPLATE, prompt), plan.format, tuple(TOOLS))


def kvlm_shape(reasoning: str | None, content: str | None) -> tuple[str | None, str | None]:
    """vLLM's reasoning and content as kvlm documents returning them: reasoning stripped, content without its leading
    whitespace, either null when nothing but whitespace is left."""
    reasoning = reasoning.strip() if reasoning else None
    return reasoning or None, content.lstrip() if content and content.strip() else None


WEATHER_CALL = xml_call("get_weather", city="Zürich", days="3", threshold="21.5",
                        options='{"unit": "celsius", "hourly": true}')
# name: (enable_thinking, output as Qwen3.5 writes it (from the <think> the prompt opened), finish_reason,
#        vLLM's (reasoning_content, content, [(name, arguments)], finish_reason))
OUTPUTS = {
    "reasoning, then a call with string, number and object parameters": (
        True, "The user wants the weather in Zürich for three days.\n</think>\n\n" + WEATHER_CALL, "stop",
        ("The user wants the weather in Zürich for three days.\n", "\n\n",
         [("get_weather", {"city": "Zürich", "days": 3, "threshold": 21.5,
                           "options": {"unit": "celsius", "hourly": True}})], "tool_calls")),
    "reasoning, then two calls in one message": (
        True, "Two things to look up.\n</think>\n\n" + xml_call("get_weather", city="Paris") + "\n"
        + xml_call("get_time", zone="Europe/Paris"), "stop",
        ("Two things to look up.\n", "\n\n",
         [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Europe/Paris"})], "tool_calls")),
    "reasoning, then plain content": (
        True, "A greeting; no tool needed.\n</think>\n\nHello! How can I help you today?", "stop",
        ("A greeting; no tool needed.\n", "\n\nHello! How can I help you today?", [], "stop")),
    "reasoning, prose, then a call": (
        True, "I should look it up.\n</think>\n\nLet me check the forecast.\n\n" + xml_call("get_weather", city="Rome"),
        "stop",
        ("I should look it up.\n", "\n\nLet me check the forecast.\n\n", [("get_weather", {"city": "Rome"})],
         "tool_calls")),
    "an array and a multi-line string": (
        True, "Fields and a note.\n</think>\n\n" + xml_call("get_weather", city="Bern", fields='["wind", "rain"]',
                                                            note="First line,\n  second line."), "stop",
        ("Fields and a note.\n", "\n\n",
         [("get_weather", {"city": "Bern", "fields": ["wind", "rain"], "note": "First line,\n  second line."})],
         "tool_calls")),
    "reasoning cut off by max_tokens": (
        True, "The user asks about the weather, so I", "length",
        ("The user asks about the weather, so I", None, [], "length")),
    "thinking off: plain content": (
        False, "Hello! How can I help?", "stop", (None, "Hello! How can I help?", [], "stop")),
    "thinking off: a call": (
        False, xml_call("get_time", zone="Asia/Tokyo"), "stop",
        (None, None, [("get_time", {"zone": "Asia/Tokyo"})], "tool_calls")),
    # vLLM's Qwen3ReasoningParser: "Qwen3.5 models may emit <tool_call> inside the thinking block without closing
    # </think> first. <tool_call> is treated as an implicit end of reasoning" (when <function= follows).
    "a call inside the think block, without </think>": (
        True, "I will call the tool.\n\n" + xml_call("get_weather", city="Lima"), "stop",
        ("I will call the tool.\n\n", None, [("get_weather", {"city": "Lima"})], "tool_calls")),
    "two calls inside the think block": (
        True, "Both.\n" + xml_call("get_weather", city="Lima") + "\n" + xml_call("get_time", zone="America/Lima"),
        "stop",
        ("Both.\n", None, [("get_weather", {"city": "Lima"}), ("get_time", {"zone": "America/Lima"})], "tool_calls")),
    # ... but not a mere mention of <tool_call>, with no <function= after it
    "<tool_call> mentioned in the reasoning": (
        True, "I could write <tool_call> now, or not.\n</think>\n\nNo tool needed.", "stop",
        ("I could write <tool_call> now, or not.\n", "\n\nNo tool needed.", [], "stop")),
    "<tool_call> at the end of reasoning cut off by max_tokens": (
        True, "Calling it.\n<tool_call>\n<func", "length", ("Calling it.\n<tool_call>\n<func", None, [], "length")),
    # The template writes past arguments with `| string`, so the model sees Python's True/False/None; vLLM's
    # qwen3_coder parser reads booleans case-insensitively and "None"/"null" as null for non-string (or nullable)
    # parameters.
    "Python literals for a boolean and a null": (
        True, "Hourly, no note.\n</think>\n\n" + xml_call("get_weather", city="Oslo", hourly="True", note="None"),
        "stop",
        ("Hourly, no note.\n", "\n\n", [("get_weather", {"city": "Oslo", "hourly": True, "note": None})],
         "tool_calls")),
    "None for an integer, FALSE for a boolean, None for a string": (
        True, "Defaults.\n</think>\n\n" + xml_call("get_weather", city="None", days="None", hourly="FALSE"),
        "stop",
        ("Defaults.\n", "\n\n", [("get_weather", {"city": "None", "days": None, "hourly": False})], "tool_calls")),
    # vLLM's numbers: int() for an integer parameter, float() for a number one, given as an int when integral
    "an integer written with a leading zero, an integral number": (
        True, "Numbers.\n</think>\n\n" + xml_call("get_weather", city="Rome", days="07", threshold="3.0"), "stop",
        ("Numbers.\n", "\n\n", [("get_weather", {"city": "Rome", "days": 7, "threshold": 3})], "tool_calls")),
}


def whole(spec: ChatOutputSpec, text: str, finish_reason: str) -> tuple:
    message, finish = spec.message(text, finish_reason)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    return message.get("reasoning_content"), message["content"], calls, finish


def check_as_vllm(enable_thinking, text, finish_reason, vllm) -> None:
    spec = output_spec(enable_thinking)
    reasoning, content, calls, finish = vllm
    expected = (*kvlm_shape(reasoning, content), calls, finish)
    assert whole(spec, text, finish_reason) == expected
    for piece in (1, 3, 8):  # the streamed deltas assembled, the output given character by character and in chunks
        got, stream_finish = streamed(spec, text, finish_reason, piece)
        assert (got["reasoning_content"] or None, got["content"] or None, stream_finish) == (*expected[:2], finish)
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["tool_calls"].items())] == calls


@pytest.mark.parametrize("name", OUTPUTS)
def test_outputs_read_as_vllm_reads_them(name):
    check_as_vllm(*OUTPUTS[name])


def test_a_call_inside_the_think_block_streamed_token_by_token(tokenizers):
    """As the server streams it: one delta per token of Qwen3.5's vocabulary (<tool_call> one token), the reasoning
    before the call, then the call; `<tool_call>` is not sent as reasoning while <function= may still follow."""
    text = "I will call the tool.\n\n" + xml_call("get_weather", city="Lima", days="2")
    tokenizer = tokenizers["Qwen3.5"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text and "<tool_call>" in [tokenizer.decode([i]) for i in ids]
    stream, sent = ChoiceStream(output_spec()), ""
    deltas = []
    for i in range(len(ids)):
        piece = tokenizer.decode(ids[:i + 1])[len(sent):]
        sent += piece
        deltas += stream.deltas(piece)
    deltas += stream.last_deltas()
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "I will call the tool." and not any(d.get("content") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and stream.finish_reason("stop") == "tool_calls"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Lima", "days": 2}
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("reasoning_content" not in d for d in deltas[first_call:])


def test_arguments_are_json_text_as_openai_sends_it():
    """The arguments of the first case as text: keys in the model's order, non-ASCII unescaped, numbers as written."""
    message, _ = output_spec().message(OUTPUTS["reasoning, then a call with string, number and object parameters"][1],
                                       "stop")
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["arguments"] == ('{"city": "Zürich", "days": 3, "threshold": 21.5, '
                                             '"options": {"unit": "celsius", "hourly": true}}')


@pytest.mark.parametrize("content", ["", "Let me check."])
def test_what_the_template_writes_of_a_turn_reads_back_as_that_turn(tokenizers, content):
    """A past assistant turn, rendered by the template (after the last user query, so with its think block), read by
    kvlm from the generation prompt's <think> on: the reasoning, content and calls it was made of."""
    turn = {"role": "assistant", "content": content, "reasoning_content": "I need the forecast.",
            "tool_calls": [CALL, TIME_CALL]}
    rendered = render(tokenizers["Qwen3.5"], [ASK, turn], False, TOOLS)
    head = render(tokenizers["Qwen3.5"], [ASK], True, TOOLS)
    assert head.endswith(OPEN_THINK) and rendered.startswith(head) and rendered.endswith("<|im_end|>\n")
    output = rendered[len(head):-len("<|im_end|>\n")]  # what the model would have written
    reasoning, got_content, calls, finish = whole(output_spec(), output, "stop")
    assert reasoning == turn["reasoning_content"] and finish == "tool_calls"
    # the text before the first <tool_call>, where the template put "\n\n" after the content (vLLM's parsers return
    # it with the "\n\n" after </think> in front too, which kvlm drops)
    assert got_content == (content + "\n\n" if content else None)
    assert calls == [("get_weather", ARGUMENTS), ("get_time", TIME_CALL["function"]["arguments"])]


# --- through the server, end to end ------------------------------------------------------------------------------

SCRIPTED_CALL = "Need the weather.\n</think>\n\n" + xml_call("get_weather", city="Paris", days="3") + "<|im_end|>"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = llama_config(vocab_size=BYTE_LEVEL_SIZE + len(CHAT_TOKENS))
    path = write_gguf(tmp_path_factory.mktemp("qwen35-template") / "tiny.gguf", qwen35_metadata(config=config),
                      gguf_tensors(random_llama(config)))
    return load_model(str(path), "float32", progress=False)


def test_the_file_keeps_the_template_and_its_chat_tokens(model):
    assert model.tokenizer.chat_template == TEMPLATE
    ids = model.tokenizer.encode("<think></think><tool_call></tool_call><|im_end|>", add_special_tokens=False)
    assert ids == list(range(BYTE_LEVEL_SIZE + 1, BYTE_LEVEL_SIZE + 5)) + [BYTE_LEVEL_SIZE]
    assert BYTE_LEVEL_SIZE in model.tokenizer.stop_ids  # <|im_end|>


def test_a_chat_completion_with_tools_whole_and_streamed(client, model, script, reference_tokenizer):
    write(script, model, SCRIPTED_CALL)
    expected = ("Need the weather.", None, [("get_weather", '{"city": "Paris", "days": 3}')], "tool_calls")
    response = client.chat.completions.create(model=MODEL, messages=[ASK], tools=TOOLS, temperature=0,
                                              max_tokens=100)
    choice = response.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert (choice.message.model_extra.get("reasoning_content"), choice.message.content, calls,
            choice.finish_reason) == expected
    assert model.tokenizer.decode(script["prompts"][-1]) == reference(reference_tokenizer, TEMPLATE, [ASK], True,
                                                                      TOOLS)

    reasoning, content, streamed_calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=[ASK], tools=TOOLS, temperature=0,
                                                max_tokens=100, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:
                streamed_calls[part.index] = [part.function.name, ""]
            streamed_calls[part.index][1] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning or None, content or None, [tuple(streamed_calls[i]) for i in sorted(streamed_calls)],
            finish) == expected

    # The SDK's message sent back with the tool's result: the next prompt is transformers' rendering of the turns.
    write(script, model, "The tool says sunny.\n</think>\n\nIt will be sunny.<|im_end|>")
    tool_result = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny"}
    second = client.chat.completions.create(model=MODEL, messages=[ASK, choice.message, tool_result], tools=TOOLS,
                                            temperature=0, max_tokens=100).choices[0]
    assert (second.message.model_extra.get("reasoning_content"), second.message.content, second.finish_reason) == (
        "The tool says sunny.", "It will be sunny.", "stop")
    sent_back = {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}
    assert model.tokenizer.decode(script["prompts"][-1]) == reference(
        reference_tokenizer, TEMPLATE, [ASK, sent_back, tool_result], True, TOOLS)


def test_enable_thinking_false_reaches_the_template(client, model, script):
    write(script, model, "It is sunny.<|im_end|>")
    choice = client.chat.completions.create(model=MODEL, messages=[ASK], temperature=0, max_tokens=20,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert model.tokenizer.decode(script["prompts"][-1]).endswith(CLOSED_THINK)
    assert (choice.message.model_extra.get("reasoning_content"), choice.message.content, choice.finish_reason) == (
        None, "It is sunny.", "stop")


# --- the same turns through the Responses and Messages APIs ------------------------------------------------------
# A reasoning item / thinking block, then the call, from the scripted turn above; the prompt is transformers'
# rendering of the chat messages the request is equivalent to; the call sent back renders as chat's second turn.

SYSTEM = "Use tools."
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ANTHROPIC_TOOLS = [{"name": tool["function"]["name"], "description": tool["function"]["description"],
                    "input_schema": tool["function"]["parameters"]} for tool in TOOLS]
SCRIPTED_ARGUMENTS = {"city": "Paris", "days": 3}
SCRIPTED_ANSWER = "The tool says sunny.\n</think>\n\nIt will be sunny.<|im_end|>"
# the scripted call as chat sends it back (as in test_a_chat_completion_with_tools_whole_and_streamed)
SENT_BACK = {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": SCRIPTED_ARGUMENTS}}]}


@pytest.fixture(scope="module")
def claude(client):
    """An `anthropic` client of the same server."""
    import anthropic

    return anthropic.Anthropic(base_url=str(client.base_url).rstrip("/").removesuffix("/v1"), api_key="none",
                               max_retries=0, timeout=300)


def output_items(response) -> list[tuple]:
    shapes = []
    for item in response.output:
        if item.type == "reasoning":
            shapes.append(("reasoning", [(part.type, part.text) for part in item.content or []]))
        elif item.type == "message":
            shapes.append(("message", [(part.type, part.text) for part in item.content]))
        else:
            shapes.append((item.type, item.name, item.arguments))
    return shapes


def content_blocks(message) -> list[tuple]:
    shapes = []
    for block in message.content:
        if block.type == "thinking":
            shapes.append(("thinking", block.thinking))
        elif block.type == "text":
            shapes.append(("text", block.text))
        else:
            shapes.append((block.type, block.name, block.input))
    return shapes


REASONED_CALL_ITEMS = [("reasoning", [("reasoning_text", "Need the weather.")]),
                       ("function_call", "get_weather", '{"city": "Paris", "days": 3}')]
REASONED_CALL_BLOCKS = [("thinking", "Need the weather."), ("tool_use", "get_weather", SCRIPTED_ARGUMENTS)]


def test_a_response_with_reasoning_and_a_call_whole_and_streamed(client, model, script, reference_tokenizer):
    write(script, model, SCRIPTED_CALL)
    kwargs = dict(model=MODEL, instructions=SYSTEM, input=[{"role": "user", "content": ASK["content"]}],
                  tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=100)
    response = client.responses.create(**kwargs)
    assert model.tokenizer.decode(script["prompts"][-1]) == reference(
        reference_tokenizer, TEMPLATE, [{"role": "system", "content": SYSTEM}, ASK], True, TOOLS)
    assert output_items(response) == REASONED_CALL_ITEMS and response.status == "completed"
    call = response.output[1]
    assert call.call_id.startswith("call_") and response.output[0].id.startswith("rs_")
    assert response.usage.output_tokens == len(script["ids"])
    assert response.usage.output_tokens_details.reasoning_tokens > 0

    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert output_items(final) == REASONED_CALL_ITEMS and final.status == "completed"
    kinds = [event.type for event in events]
    n_reasoning = kinds.count("response.reasoning_text.delta")
    n_arguments = kinds.count("response.function_call_arguments.delta")
    assert n_reasoning >= 1 and n_arguments >= 1
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.reasoning_text.delta"] * n_reasoning
                     + ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                        "response.output_item.added"] + ["response.function_call_arguments.delta"] * n_arguments
                     + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"])
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Need the weather."
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == '{"city": "Paris", "days": 3}'
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]


def test_a_responses_call_sent_back_renders_as_chats_second_turn(client, model, script, reference_tokenizer):
    write(script, model, SCRIPTED_CALL)
    kwargs = dict(model=MODEL, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=100)
    first = client.responses.create(input=ASK["content"], **kwargs)
    assert model.tokenizer.decode(script["prompts"][-1]) == reference(reference_tokenizer, TEMPLATE, [ASK], True,
                                                                      TOOLS)
    assert output_items(first) == REASONED_CALL_ITEMS
    call_id = first.output[1].call_id
    result = {"type": "function_call_output", "call_id": call_id, "output": "sunny"}
    expected = reference(reference_tokenizer, TEMPLATE,
                         [ASK, SENT_BACK, {"role": "tool", "tool_call_id": call_id, "content": "sunny"}], True, TOOLS)
    answer = [("reasoning", [("reasoning_text", "The tool says sunny.")]),
              ("message", [("output_text", "It will be sunny.")])]

    write(script, model, SCRIPTED_ANSWER)
    by_id = client.responses.create(previous_response_id=first.id, input=[result], **kwargs)
    assert model.tokenizer.decode(script["prompts"][-1]) == expected
    assert output_items(by_id) == answer and by_id.output_text == "It will be sunny."
    # the same turns as input items (the SDK's own output items sent back), without previous_response_id
    whole = client.responses.create(input=[{"role": "user", "content": ASK["content"]},
                                           *[item.model_dump(exclude_none=True) for item in first.output], result],
                                    **kwargs)
    assert model.tokenizer.decode(script["prompts"][-1]) == expected
    assert output_items(whole) == answer


def test_a_message_with_thinking_and_a_tool_use_whole_and_streamed(claude, model, script, reference_tokenizer):
    write(script, model, SCRIPTED_CALL)
    kwargs = dict(model=MODEL, system=SYSTEM, messages=[ASK], tools=ANTHROPIC_TOOLS, max_tokens=100,
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    message = claude.messages.create(**kwargs)
    assert model.tokenizer.decode(script["prompts"][-1]) == reference(
        reference_tokenizer, TEMPLATE, [{"role": "system", "content": SYSTEM}, ASK], True, TOOLS, enable_thinking=True)
    assert content_blocks(message) == REASONED_CALL_BLOCKS
    assert (message.stop_reason, message.stop_sequence) == ("tool_use", None)
    assert message.usage.output_tokens == len(script["ids"])

    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert content_blocks(final) == REASONED_CALL_BLOCKS and final.stop_reason == "tool_use"
    deltas = [(e.index, e.delta) for e in events if e.type == "content_block_delta"]
    assert {d.type for _, d in deltas} == {"thinking_delta", "input_json_delta"}
    assert "".join(d.thinking for i, d in deltas if d.type == "thinking_delta" and i == 0) == "Need the weather."
    partial = "".join(d.partial_json for i, d in deltas if d.type == "input_json_delta" and i == 1)
    assert json.loads(partial) == SCRIPTED_ARGUMENTS
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    assert [e.type for e in events if e.type in ("message_start", "message_delta", "message_stop")] == [
        "message_start", "message_delta", "message_stop"]


def test_a_tool_use_sent_back_renders_as_chats_second_turn(claude, model, script, reference_tokenizer):
    write(script, model, SCRIPTED_CALL)
    kwargs = dict(model=MODEL, tools=ANTHROPIC_TOOLS, max_tokens=100, extra_body={"temperature": 0},
                  thinking={"type": "enabled", "budget_tokens": 1024})
    first = claude.messages.create(messages=[ASK], **kwargs)
    assert content_blocks(first) == REASONED_CALL_BLOCKS
    use = first.content[1]
    history = [ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    write(script, model, SCRIPTED_ANSWER)
    second = claude.messages.create(messages=history, **kwargs)
    assert model.tokenizer.decode(script["prompts"][-1]) == reference(
        reference_tokenizer, TEMPLATE, [ASK, SENT_BACK, {"role": "tool", "tool_call_id": use.id, "content": "sunny"}],
        True, TOOLS, enable_thinking=True)
    assert content_blocks(second) == [("thinking", "The tool says sunny."), ("text", "It will be sunny.")]
    assert (second.stop_reason, second.stop_sequence) == ("end_turn", None)


@pytest.mark.parametrize("thinking", [{"thinking": {"type": "disabled"}}, {}], ids=["disabled", "absent"])
def test_thinking_disabled_reaches_the_template_as_enable_thinking_false(claude, model, script, reference_tokenizer,
                                                                          thinking):
    """Disabled, or not asked for (Anthropic's default is no thinking)."""
    write(script, model, "It is sunny.<|im_end|>")
    message = claude.messages.create(model=MODEL, messages=[ASK], max_tokens=20, extra_body={"temperature": 0},
                                     **thinking)
    prompt = model.tokenizer.decode(script["prompts"][-1])
    assert prompt.endswith(CLOSED_THINK)
    assert prompt == reference(reference_tokenizer, TEMPLATE, [ASK], True, enable_thinking=False)
    assert content_blocks(message) == [("text", "It is sunny.")] and message.stop_reason == "end_turn"
