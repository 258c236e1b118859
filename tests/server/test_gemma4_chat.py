"""Gemma 4's chat template through kvlm: rendered exactly as transformers renders it.

kvlm's rendering of Google's Gemma 4 template is compared with transformers' (`PreTrainedTokenizerFast.
apply_chat_template(..., tokenize=False)` given the same template string; no expected prompt is written by hand),
with the template read from GGUF metadata, from a folder's chat_template.jinja, and reached from an OpenAI-style
request through the server's chat_prompt. The cases cover what the template does: the `<|turn>role ... <turn|>`
turns; `enable_thinking` (a `<|think|>` system turn and a bare `<|turn>model` generation prompt, else an empty
`<|channel>thought\\n<channel|>` after it); past reasoning written as a thought channel only on a tool-calling turn
after the last user message, and thought channels inside a model's content stripped (strip_thinking); tools declared
as `<|tool>declaration:name{...}<tool|>` with `<|"|>`-quoted strings and sorted keys; calls as
`<|tool_call>call:name{key:value}<tool_call|>`; results as `<|tool_response>response:name{value:...}<tool_response|>`
inside the model's turn (no new generation prompt after them); content as a list of parts. The template has no
raise_exception: it refuses nothing on purpose (roles in any order render), and only fails where a message lacks
what it reads, which kvlm must fail on alike.

Both sides see the same vocabulary, the byte-level one of gguf_factory plus `<bos>`, `<eos>` and Gemma 4's chat
tokens as added tokens (not special), so the template's bos_token is `<bos>` in both and the prompts also tokenize
alike.

Provenance of tests/data/gemma4-chat-template.jinja (16448 bytes, ending in a newline, SHA-256 below):
- Byte for byte models/templates/google-gemma-4-31B-it.jinja of llama.cpp as mirrored in Raudbjorn/ggml-llama.cpp
  (HEAD ae1a0b1c71a8b3a86ede8cb5892ed9ce967d00b2), where the file last changed in
  3fc65063d9c356510b86fc2f15ca8aea711bfc47 "common : better align to the updated official gemma4 template
  (#21704)", 2026-04-10 (added by b8635075ffe27b135c49afb9a8b5c434bd42c502, "common : add gemma 4 specialized parser
  (#21418)"). Its "-interleaved" sibling (a variant that writes reasoning_content between tool calls), changed by
  the same two commits, is not used here.
- Only llama.cpp's copy was used: no other public copy of these bytes was found. llama.cpp forks hold other versions
  at the same path (CompleteTech-LLC-AI-Research/llama.cpp's, at ff89113109acfd5d37d9823a0a437ac6c15f8638, reads as
  this one but for its generation prompt, which opens `<|channel>thought\n` when enable_thinking instead of closing
  an empty one when not), and later versions of the template differ more: vllm-project/vllm's examples/
  tool_chat_template_gemma4.jinja (as stored at 03a5e85548b1b5f628f2793e80b820086e6a5dcc: a filter_keys argument to
  format_parameters, a system message's parts written one by one, content captured before it is written) and
  Unsloth's (a format_type_argument macro).
"""
from __future__ import annotations

import copy
import hashlib
import json

import jinja2
import pytest
from helpers.chat import ASK, CALL, RESULT, TIME, TIME_CALL, TOOL_TURNS, USER, reference, render
from helpers.gemma4_chat import BOS, TEMPLATE, TEMPLATE_PATH, gemma4_chat_metadata
from helpers.gguf_factory import template_folder_tokenizers

from kvlm.server.chat_turn import chat_prompt
from kvlm.server.protocol import ChatCompletionRequest
from kvlm.text.tokenizer import Tokenizer

TEMPLATE_SHA256 = "85a08664d16d8f3be4416c92427b3ac10df1024ac566cc0b4bc3bab409393f98"


NO_THOUGHT = "<|turn>model\n<|channel>thought\n<channel|>"  # the generation prompt with thinking off (the default)
THINKING = "<|turn>model\n"  # ... and on

# A declaration with every kind of parameter the template writes its own way: a string with an enum, a nullable
# number, an integer, an array of strings, an array of objects with their own required list, an object with
# properties and a required list, a boolean; a description with quotes and non-ASCII.
FLIGHTS = {"type": "function", "function": {
    "name": "search_flights", "description": 'Flights between two airports, e.g. "ZRH" → "NRT"',
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "description": "IATA code of the departure airport"},
        "destination": {"type": "string"},
        "cabin": {"type": "string", "enum": ["economy", "business", "first"]},
        "max_price": {"type": "number", "description": "In CHF", "nullable": True},
        "stops": {"type": "integer"},
        "dates": {"type": "array", "items": {"type": "string"}},
        "passengers": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}},
        "filters": {"type": "object", "properties": {
            "direct": {"type": "boolean"}, "airlines": {"type": "array", "items": {"type": "string"}}},
            "required": ["direct"]},
        "flexible": {"type": "boolean"},
    }, "required": ["origin", "destination"]}}}
WEATHER = {"type": "function", "function": {  # the tool CALL (from helpers.chat) calls
    "name": "get_weather", "description": "Current weather and forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "threshold": {"type": "number"},
        "options": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                                     "hourly": {"type": "boolean"}}},
        "fields": {"type": "array", "items": {"type": "string"}}}, "required": ["city"]}}}
TOOLS = [FLIGHTS, WEATHER, TIME]


# name: (messages, add_generation_prompt, tools, template kwargs)
CONVERSATIONS = {
    "user only": ([USER], True, None, {}),
    "user only, no generation prompt": ([USER], False, None, {}),
    "enable_thinking true": ([USER], True, None, {"enable_thinking": True}),
    "enable_thinking false": ([USER], True, None, {"enable_thinking": False}),
    "system and user": ([{"role": "system", "content": "  Answer in French.\n"}, USER], True, None, {}),
    "developer and user, thinking on": ([{"role": "developer", "content": "Be brief."}, USER], True, None,
                                        {"enable_thinking": True}),
    # A user's parts trimmed one by one, an image part as <|image|>; a model's parts through strip_thinking.
    "content as parts, with an image": ([
        {"role": "user", "content": [{"type": "text", "text": " Describe this "}, {"type": "image"},
                                     {"type": "text", "text": "in one word.\n"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "<|channel>thought\nA cat.<channel|>Cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, {"type": "audio"}]},
    ], True, None, {}),
    # The system message is trimmed as a string: a list of parts is written as the list's Python repr.
    "system content as parts": ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, USER],
                                True, None, {}),
    # Reasoning of a turn without tool calls is not written; a thought channel in the content is stripped.
    "multi-turn": ([
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "<|channel>thought\nAdd again.<channel|>\n6 "},
    ], False, None, {}),
    "multi-turn, reasoning under vLLM's name, the next question": ([
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4", "reasoning": "Add."},
        {"role": "user", "content": "And 3 + 3?"},
    ], True, None, {}),
    # The template checks no order: a late system message and two user turns in a row render as given.
    "roles out of order": ([USER, {"role": "user", "content": "Again."}, {"role": "system", "content": "Late."},
                            {"role": "assistant", "content": "Hello"}], True, None, {}),
    "tools, system and thinking": ([{"role": "system", "content": "Use tools."}, ASK], True, TOOLS,
                                   {"enable_thinking": True}),
    # Reasoning written (a tool-calling turn after the last user message), the result inside the model's turn, and
    # no generation prompt after it: the model goes on in the same turn.
    "reasoning, a call with dict arguments, its result": (TOOL_TURNS, True, TOOLS, {}),
    # Reasoning not written (before the last user message); a result as text parts; the answer after the results
    # continues the same model turn.
    "content and two calls, two results, the answer": ([
        ASK,
        {"role": "assistant", "content": "Let me check both.", "reasoning_content": "Two tools.",
         "tool_calls": [CALL, TIME_CALL]},
        RESULT,
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
        {"role": "assistant", "content": "Sunny, 21 °C, and it is 14:05.", "reasoning_content": "Both came back."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ], True, TOOLS, {"enable_thinking": False}),
    # A call with no result yet: the turn ends in <|tool_response>, and no generation prompt follows.
    "a call awaiting its result": ([ASK, {"role": "assistant", "content": "", "tool_calls": [TIME_CALL]}], True, TOOLS,
                                   {}),
    # Arguments as a JSON string are written between the braces as they are.
    "arguments as a JSON string": ([ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}], False, TOOLS, {}),
    # Google's own form: results on the assistant message, a mapping written key by key.
    "tool_responses on the assistant message": ([ASK, {
        "role": "assistant", "tool_calls": [TIME_CALL],
        "tool_responses": [{"name": "get_time", "response": {"time": "14:05", "dst": True, "offset": 2}}]}],
        True, TOOLS, {}),
}
# Inputs the template cannot render (it has no raise_exception): each must fail in kvlm as in transformers.
REFUSED = {
    "a message without a role": [USER, {"content": "Who am I?"}],
    "a call without a name": [ASK, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"arguments": {"zone": "UTC"}}}]}],
    "a function name that is not a string": [ASK, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": 7, "arguments": {}}}]}],
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """kvlm's tokenizer built from GGUF metadata carrying the template, as a file's metadata reaches it."""
    return Tokenizer.from_gguf_metadata(gemma4_chat_metadata())


def rendered(hf_tokenizer, name: str) -> str:
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
    return reference(hf_tokenizer, TEMPLATE, messages, add_generation_prompt, tools, **kwargs)


# --- the template --------------------------------------------------------------------------------------------------

def test_the_template_file_is_gemma4s():
    data = TEMPLATE_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == TEMPLATE_SHA256 and len(data) == 16448
    assert b"\r" not in data and data.endswith(b"{%- endif -%}\n")
    # The updated template (not the "-interleaved" one): results forward-scanned from OpenAI's tool messages,
    # reasoning under either name.
    for marker in ("strip_thinking", "<|channel>thought", "<|tool_call>call:", '<|"|>', "enable_thinking",
                   "format_tool_response_block", "message.get('reasoning') or message.get('reasoning_content')",
                   "bos_token", "dictsort"):
        assert marker in TEMPLATE
    assert "raise_exception" not in TEMPLATE


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_renders_as_transformers(tokenizer, reference_tokenizer, name):
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
    expected = rendered(reference_tokenizer, name)
    assert expected.startswith(BOS + "<|turn>")
    assert render(tokenizer, messages, add_generation_prompt, tools, **kwargs) == expected


def test_conversations_reach_the_branches_they_name(reference_tokenizer):
    """Guards the cases above against a template or input change that would make them test nothing."""
    def text(name):
        return rendered(reference_tokenizer, name)

    assert text("user only") == BOS + "<|turn>user\n" + USER["content"] + "<turn|>\n" + NO_THOUGHT
    assert text("user only, no generation prompt").endswith("<turn|>\n")
    assert text("enable_thinking true").startswith(BOS + "<|turn>system\n<|think|>\n<turn|>\n")
    assert text("enable_thinking true").endswith("<turn|>\n" + THINKING)
    assert text("enable_thinking false") == text("user only")
    assert text("system and user").startswith(BOS + "<|turn>system\nAnswer in French.<turn|>\n<|turn>user\n")
    assert text("developer and user, thinking on").startswith(BOS + "<|turn>system\n<|think|>\nBe brief.<turn|>\n")
    parts = text("content as parts, with an image")
    assert "<|turn>user\nDescribe this<|image|>in one word.<turn|>\n<|turn>model\nCat.<turn|>\n" in parts
    assert "And this?<|audio|><turn|>" in parts
    assert "<|turn>system\n[{'type': 'text', 'text': 'Be brief.'}]<turn|>" in text("system content as parts")
    turns = text("multi-turn")
    assert "Simple sum." not in turns and "Add again." not in turns
    assert turns.endswith("<|turn>model\n4<turn|>\n<|turn>user\nAnd 3 + 3?<turn|>\n<|turn>model\n6<turn|>\n")
    assert "Add." not in text("multi-turn, reasoning under vLLM's name, the next question")
    assert "<|turn>user\nAgain.<turn|>\n<|turn>system\nLate.<turn|>\n<|turn>model\nHello<turn|>\n" in text(
        "roles out of order")
    declared = text("tools, system and thinking")
    assert declared.startswith(BOS + "<|turn>system\n<|think|>\nUse tools.<|tool>declaration:search_flights{")
    for piece in ('description:<|"|>Flights between two airports, e.g. "ZRH" → "NRT"<|"|>',
                  'cabin:{enum:[<|"|>economy<|"|>,<|"|>business<|"|>,<|"|>first<|"|>],type:<|"|>STRING<|"|>}',
                  'max_price:{description:<|"|>In CHF<|"|>,nullable:true,type:<|"|>NUMBER<|"|>}',
                  'passengers:{items:{properties:{age:{type:<|"|>INTEGER<|"|>},name:{type:<|"|>STRING<|"|>}},'
                  'required:[<|"|>name<|"|>],type:<|"|>OBJECT<|"|>},type:<|"|>ARRAY<|"|>}',
                  'required:[<|"|>direct<|"|>],type:<|"|>OBJECT<|"|>}',
                  'required:[<|"|>origin<|"|>,<|"|>destination<|"|>],type:<|"|>OBJECT<|"|>}}<tool|>'):
        assert piece in declared
    assert declared.endswith("<tool|><turn|>\n<|turn>user\n" + ASK["content"] + "<turn|>\n" + THINKING)
    call = text("reasoning, a call with dict arguments, its result")
    assert call.endswith(
        "<|turn>model\n<|channel>thought\nI need the forecast.\n<channel|><|tool_call>call:get_weather{city:"
        "<|\"|>Zürich<|\"|>,days:2,fields:[<|\"|>wind<|\"|>,<|\"|>rain<|\"|>],"
        "options:{hourly:false,unit:<|\"|>celsius<|\"|>},threshold:21.5}<tool_call|>"
        "<|tool_response>response:get_weather{value:<|\"|>" + RESULT["content"] + "<|\"|>}<tool_response|>")
    two = text("content and two calls, two results, the answer")
    assert "Two tools." not in two and "Both came back." not in two
    assert ("<tool_call|><|tool_call>call:get_time{zone:<|\"|>Europe/Zurich<|\"|>}<tool_call|><|tool_response>"
            "response:get_weather{value:") in two
    assert ("<|tool_response>response:get_time{value:<|\"|>14:05<|\"|>}<tool_response|>Let me check both.<turn|>\n"
            "Sunny, 21 °C, and it is 14:05.<turn|>\n<|turn>user\n") in two
    assert two.endswith(NO_THOUGHT)
    assert text("a call awaiting its result").endswith("call:get_time{zone:<|\"|>Europe/Zurich<|\"|>}<tool_call|>"
                                                       "<|tool_response>")
    assert 'call:get_time{{"zone": "UTC"}}<tool_call|><|tool_response>' in text("arguments as a JSON string")
    assert text("tool_responses on the assistant message").endswith(
        "<tool_call|><|tool_response>response:get_time{dst:true,offset:2,time:<|\"|>14:05<|\"|>}<tool_response|>")


@pytest.mark.parametrize("name", REFUSED)
def test_fails_as_transformers_does(tokenizer, reference_tokenizer, name):
    with pytest.raises(Exception) as theirs:
        reference(reference_tokenizer, TEMPLATE, REFUSED[name], True, TOOLS)
    with pytest.raises(Exception) as ours:
        render(tokenizer, REFUSED[name], True, TOOLS)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    assert isinstance(ours.value, TypeError if name == "a function name that is not a string" else
                      jinja2.UndefinedError)


def test_an_empty_conversation_fails_in_both(tokenizer, reference_tokenizer):
    """transformers refuses it before rendering (a ValueError of its own); kvlm's render fails where the template
    reads messages[0] (a request cannot reach it: the server wants at least one message)."""
    with pytest.raises(ValueError, match="empty conversation"):
        reference(reference_tokenizer, TEMPLATE, [], True)
    with pytest.raises(jinja2.UndefinedError):
        render(tokenizer, [], True)


@pytest.mark.parametrize("name", ["tools, system and thinking", "content and two calls, two results, the answer"])
def test_the_prompt_tokenizes_as_transformers_tokenizes_it(tokenizer, reference_tokenizer, name):
    """Same vocabulary on both sides: the chat tokens each one token, `<bos>` once, at the start."""
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
    expected = rendered(reference_tokenizer, name)
    ids = tokenizer.encode_chat(copy.deepcopy(messages), add_generation_prompt, copy.deepcopy(tools), **kwargs)
    assert ids == reference_tokenizer.encode(expected, add_special_tokens=False)
    chat_ids = {reference_tokenizer.convert_tokens_to_ids(t) for t in ("<|turn>", "<turn|>", '<|"|>', "<|tool>")}
    assert ids[0] == reference_tokenizer.bos_token_id and ids.count(ids[0]) == 1 and chat_ids <= set(ids)


def test_a_folders_chat_template_jinja(tmp_path):
    """A release folder's chat_template.jinja; kvlm and transformers each read the folder (bos_token from it)."""
    ours, from_folder = template_folder_tokenizers(tmp_path, TEMPLATE_PATH.read_bytes())
    assert ours.chat_template == from_folder.chat_template == TEMPLATE
    for name in ("reasoning, a call with dict arguments, its result", "tools, system and thinking"):
        messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
        assert render(ours, messages, add_generation_prompt, tools, **kwargs) == from_folder.apply_chat_template(
            copy.deepcopy(messages), tools=copy.deepcopy(tools), tokenize=False,
            add_generation_prompt=add_generation_prompt, **kwargs)


def openai_body(**extra) -> ChatCompletionRequest:
    """TOOL_TURNS as an OpenAI client sends them: a developer message, arguments as a JSON string, content null."""
    return ChatCompletionRequest.model_validate({
        "messages": [
            {"role": "developer", "content": "Use tools."},
            ASK,
            {"role": "assistant", "content": None, "reasoning_content": "I need the forecast.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather",
                    "arguments": json.dumps(CALL["function"]["arguments"], ensure_ascii=False)}}]},
            RESULT,
        ],
        "tools": TOOLS, **extra})


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_an_openai_request_renders_as_transformers_renders_its_messages(tokenizer, reference_tokenizer, kwargs,
                                                                        add_generation_prompt):
    """The server's path: the request's turns give the prompt transformers makes of them written its way (arguments
    as an object; developer as system, which this template reads alike), chat_template_kwargs reaching the
    template."""
    body = openai_body(add_generation_prompt=add_generation_prompt,
                       **({"chat_template_kwargs": kwargs} if kwargs else {}))
    expected = reference(reference_tokenizer, TEMPLATE, [{"role": "system", "content": "Use tools."}, *TOOL_TURNS],
                         add_generation_prompt, TOOLS, **kwargs)
    assert chat_prompt(tokenizer, body, body.tool_dicts()) == expected
    assert ("<|think|>" in expected) == bool(kwargs.get("enable_thinking"))
    assert reference(reference_tokenizer, TEMPLATE, [{"role": "developer", "content": "Use tools."}, *TOOL_TURNS],
                     add_generation_prompt, TOOLS, **kwargs) == expected


@pytest.mark.parametrize("parts", [["Hello.", "What is the weather in Zürich?"], ["Describe ", "this picture."]])
def test_an_openai_request_with_text_parts_renders_them_as_the_template_does(tokenizer, reference_tokenizer, parts):
    """Gemma 4's template loops over a message's parts (trimming each): the server hands it the parts, as vLLM does
    for such a template (its content format "openai"), so a space at a part's edge goes as the template says."""
    parts = [{"type": "text", "text": text} for text in parts]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert tokenizer.content_format == "openai"
    assert chat_prompt(tokenizer, body) == reference(reference_tokenizer, TEMPLATE,
                                                     [{"role": "user", "content": parts}], True)
