"""Structured output and tool calls on a live server over the real Qwen2.5-Coder-0.5B, through the official
`openai` client: outputs validated with `jsonschema` against the schema asked for, tool calls against the tool's
parameters, streamed calls equal to whole ones, a second turn with the SDK's own message sent back."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from helpers.server import serving

from kvlm.engine.engine import Engine
from kvlm.server.app import create_app

MODEL = "qwen-test"
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "bounded_array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3}},
        "required": ["colors"]},
    "enum_and_limits": {"type": "object", "properties": {
        "size": {"enum": ["small", "medium", "large"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["size", "count"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
                 "required": ["title"]},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                "required": ["x", "y"]}},
            "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
               "required": ["value"]},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def qwen_engine(qwen_gguf_path):
    from kvlm.loader.load import load_model

    return Engine(load_model(str(qwen_gguf_path)), n_ctx=2048, max_num_seqs=8)


@pytest.fixture(scope="module")
def server(qwen_engine):
    with serving(create_app(qwen_engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=600)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(client, name):
    schema = SCHEMAS[name]
    response = chat(client, [{"role": "user", "content": f"Give an example JSON object for: {name}."}],
                    max_tokens=200, response_format={"type": "json_schema",
                                                     "json_schema": {"name": name, "schema": schema}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_parses_as_an_object(client):
    response = chat(client, [{"role": "user", "content": "A cat's name and color, as a JSON object."}], max_tokens=300,
                    response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_choice_regex_and_grammar(client):
    question = [{"role": "user", "content": "Is water wet?"}]
    choice = chat(client, question, max_tokens=10, extra_body={"structured_outputs": {"choice": ["maybe", "never"]}})
    assert choice.choices[0].message.content in ("maybe", "never")
    guided = chat(client, question, max_tokens=10, extra_body={"guided_choice": ["si", "no"]})
    assert guided.choices[0].message.content in ("si", "no")
    regex = chat(client, [{"role": "user", "content": "Give a phone number."}], max_tokens=20,
                 extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].message.content)
    completion = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
                                           extra_body={"grammar": 'root ::= " " ("yes" | "no") "."'})
    assert completion.choices[0].text in (" yes.", " no.")


def test_constrained_streams_equal_whole_responses(client):
    kwargs = dict(max_tokens=120, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": SCHEMAS["nested"]}})
    messages = [{"role": "user", "content": "A person and their address, as JSON."}]
    whole = chat(client, messages, **kwargs).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chat(client, messages, stream=True,
                                                                              **kwargs) if chunk.choices)
    assert streamed == whole


def test_tool_choice_required_gives_a_valid_call(client):
    # (with parallel calls allowed this small model repeats its call until max_tokens)
    response = chat(client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", max_tokens=100,
                    parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = chat(client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named, max_tokens=100,
                    parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's rule for a named function
    assert [call.function.name for call in choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), TIME["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_calls_equal_whole_ones(client, tool_choice):
    kwargs = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=100)
    whole = chat(client, ASK_WEATHER, **kwargs).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chat(client, ASK_WEATHER, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": None, "arguments": ""})
            if part.function.name is not None:
                assert call["name"] is None, "a call's name is sent once"
                call["name"] = part.function.name
            call["arguments"] += part.function.arguments or ""
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == expected
    assert (content or None) == whole.message.content
    assert finish == whole.finish_reason


def test_second_turn_sends_the_returned_message_back(client):
    first = chat(client, ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_tokens=100, store=False,
                 parallel_tool_calls=False)
    message = first.choices[0].message
    history = ASK_WEATHER + [message.model_dump(exclude_unset=False),  # every field the SDK has, nulls included
                             {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                              "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    second = chat(client, history, tools=[WEATHER], max_tokens=60, store=False)
    answer = second.choices[0]
    assert (answer.message.content or answer.message.tool_calls) and answer.finish_reason in ("stop", "length",
                                                                                             "tool_calls")


def test_bad_constraints_are_400s_and_the_server_keeps_serving(server, client):
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"type": "frob"}}}}}},
                 {"structured_outputs": {"json": {"type": "object"}, "regex": "a+"}},
                 {"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a+"}}):
        response = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK_WEATHER, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] is not None
    assert chat(client, ASK_WEATHER, max_tokens=2).choices[0].finish_reason == "length"


def test_thinking_cut_by_max_tokens_is_reasoning_with_null_content(client, qwen_engine, monkeypatch):
    """A template with <think> (Qwen3's shape): what the model writes inside is reasoning_content."""
    tokenizer = qwen_engine.model.tokenizer
    template = tokenizer.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}"
    monkeypatch.setattr(tokenizer, "chat_template", template)
    response = chat(client, ASK_WEATHER, max_tokens=5)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "length"
    assert message.content is None and message.model_extra["reasoning_content"]


def test_metrics_count_constrained_requests_and_masks(server, client):
    chat(client, ASK_WEATHER, max_tokens=5, extra_body={"structured_outputs": {"regex": "[a-z ]+"}})
    text = httpx.get(f"{server}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("kvlm_") and " " in line}
    assert values["kvlm_constrained_requests_total"] >= 1
    assert values["kvlm_grammar_masks_total"] >= 5
    assert values["kvlm_grammar_mask_seconds_total"] > 0 and values["kvlm_grammar_compile_seconds_total"] > 0


def test_llm_chat_with_tools_returns_openai_messages(qwen_engine):
    from kvlm.engine.llm import LLM
    from kvlm.sampling.params import SamplingParams

    llm = LLM(qwen_engine.model, n_ctx=1024, max_num_seqs=2)
    greedy = SamplingParams(max_tokens=80, temperature=0)
    forced = llm.chat(ASK_WEATHER, greedy, use_tqdm=False, tools=[WEATHER, TIME], tool_choice="get_weather",
                      parallel_tool_calls=False)[0]
    assert forced.finish_reason == "stop" and forced.message["content"] is None
    [call] = forced.message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    free = llm.chat(ASK_WEATHER, greedy, use_tqdm=False, tools=[WEATHER])[0]
    parsed = {"role": "assistant", "content": None, "tool_calls": []} if free.message is None else free.message
    assert free.message is not None and (parsed["content"] or parsed.get("tool_calls"))
    with pytest.raises(ValueError, match="nope"):
        llm.chat(ASK_WEATHER, greedy, use_tqdm=False, tools=[WEATHER], tool_choice="nope")
