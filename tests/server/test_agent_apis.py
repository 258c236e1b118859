"""OpenAI's Responses API and Anthropic's Messages API on a live server over the real Qwen2.5-Coder-0.5B, through
the official `openai` and `anthropic` clients and the OpenAI Agents SDK (`agents`).

Every expectation is a value another path computes: a response's text and token counts are those of the chat
completion of the same messages (greedy), a streamed response is the whole one, a conversation continued by
previous_response_id is the same prompt as the one sent whole, count_tokens is the length of transformers' rendering
of the same conversation, a stopped message is the unstopped one cut before its stop sequence; calls are validated
with `jsonschema` against the tool's parameters. The server is created with an API key, which every client sends
(OpenAI's as `Authorization: Bearer`, Anthropic's as `x-api-key`).
"""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from helpers.server import serving

from kvlm.engine.engine import Engine
from kvlm.server.app import create_app

MODEL = "qwen-agent-apis"
KEY = "kvlm-test-key"
INSTRUCTIONS = "You are a terse assistant."
SHORT = "Reply with one word: what is the capital of France?"
LONG = "Write a long story about a dragon."  # an answer longer than any max_tokens here
ASK = "What is the weather like in Paris today?"

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city"]}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
SPECS = [("get_weather", "The current weather in a city", WEATHER_PARAMETERS),
         ("get_time", "The local time in a time zone", TIME_PARAMETERS)]
PARAMETERS = {name: parameters for name, _, parameters in SPECS}
# the same two tools as each API writes them
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}} for n, d, p in SPECS]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": d, "parameters": p} for n, d, p in SPECS]
ANTHROPIC_TOOLS = [{"name": n, "description": d, "input_schema": p} for n, d, p in SPECS]
GREEDY = {"temperature": 0}  # for the anthropic SDK, through extra_body


@pytest.fixture(scope="module")
def qwen_engine(qwen_gguf_path):
    from kvlm.loader.load import load_model

    return Engine(load_model(str(qwen_gguf_path)), n_ctx=2048, max_num_seqs=4)


@pytest.fixture(scope="module")
def server(qwen_engine):
    with serving(create_app(qwen_engine, MODEL, api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=600)


def chat(oai, messages, **kwargs):
    return oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def respond(oai, **kwargs):
    return oai.responses.create(model=MODEL, temperature=0, **kwargs)


def message(claude, **kwargs):
    return claude.messages.create(model=MODEL, extra_body=GREEDY, **kwargs)


def items(response) -> list[tuple]:
    """A response's output items without their ids: what the model wrote."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append((item.type, item.name, item.arguments, item.status))
        elif item.type == "message":
            out.append((item.type, item.role, [(c.type, c.text) for c in item.content], item.status))
        else:
            out.append((item.type, item.model_dump(exclude={"id"})))
    return out


# --- Responses ------------------------------------------------------------------------------------------------------

def test_a_response_is_the_chat_completion_of_its_messages(oai, hf_qwen_tokenizer):
    response = respond(oai, instructions=INSTRUCTIONS, input=SHORT, max_output_tokens=24)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": SHORT}]
    completion = chat(oai, messages, max_tokens=24)
    choice = completion.choices[0]
    assert response.output_text and response.output_text == choice.message.content
    assert response.status == ("completed" if choice.finish_reason == "stop" else "incomplete")
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [part.type for part in item.content] == ["output_text"]
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 24
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (completion.usage.prompt_tokens,
                                                         completion.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # ... and the prompt is transformers' rendering of the messages
    expected = hf_qwen_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert usage.input_tokens == len(hf_qwen_tokenizer.encode(expected, add_special_tokens=False))


def test_a_streamed_response_is_the_whole_one(oai):
    whole = respond(oai, input=SHORT, max_output_tokens=30)
    assert whole.status == "completed", whole.output_text
    with oai.responses.stream(model=MODEL, input=SHORT, max_output_tokens=30, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    [item] = final.output
    item_events = [e for e in events if e.type not in ("response.created", "response.in_progress",
                                                       "response.completed")]
    assert {e.item.id if e.type.startswith("response.output_item") else e.item_id for e in item_events} == {item.id}
    assert {e.output_index for e in item_events} == {0}
    assert events[-4].text == deltas and events[-3].part.text == deltas
    assert events[-2].item.content[0].text == deltas and events[-2].item.status == "completed"
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].response.usage.input_tokens == whole.usage.input_tokens


def test_a_function_call_and_its_output_sent_back_two_ways(oai):
    first = respond(oai, input=ASK, tools=RESPONSES_TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=100)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    [call] = first.output
    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert first.parallel_tool_calls is False and first.tool_choice == "required"

    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temperature": 21, "unit": "celsius"})}
    kwargs = dict(tools=RESPONSES_TOOLS, max_output_tokens=40)
    by_id = respond(oai, previous_response_id=first.id, input=[result], **kwargs)
    whole = respond(oai, input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result],
                    **kwargs)
    assert by_id.previous_response_id == first.id and whole.previous_response_id is None
    assert items(by_id) == items(whole) and by_id.output
    assert by_id.usage.input_tokens == whole.usage.input_tokens
    assert (by_id.usage.output_tokens, by_id.status) == (whole.usage.output_tokens, whole.status)
    # the same conversation as chat messages: the same prompt, the same reply
    completion = chat(oai, [{"role": "user", "content": ASK},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": call.call_id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}]},
                            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}],
                      tools=CHAT_TOOLS, max_tokens=40)
    assert whole.usage.input_tokens == completion.usage.prompt_tokens
    assert (whole.output_text or None) == completion.choices[0].message.content


def test_retrieve_and_delete(oai):
    created = respond(oai, input=SHORT, max_output_tokens=8)
    retrieved = oai.responses.retrieve(created.id)
    assert retrieved.model_dump() == created.model_dump()
    unstored = respond(oai, input=SHORT, max_output_tokens=2, store=False)
    oai.responses.delete(created.id)
    for response_id in (created.id, unstored.id):
        with pytest.raises(openai.NotFoundError) as missing:
            oai.responses.retrieve(response_id)
        assert missing.value.status_code == 404 and response_id in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(created.id)


def test_a_json_schema_format_validates(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    response = respond(oai, input="A person's name and age, as JSON.", max_output_tokens=60,
                       text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"


def test_max_output_tokens_makes_an_incomplete_response(oai):
    response = respond(oai, input=LONG, max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.output[-1].status == "incomplete"
    events = list(oai.responses.create(model=MODEL, input=LONG, max_output_tokens=5, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[-1] == "response.incomplete" and "response.completed" not in kinds
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.output_text == response.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text


@pytest.mark.parametrize("kwargs, param", [
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}]}]},
     "input[0].content[1].type"),
    ({"input": "Search the web for today's news.", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": SHORT, "background": True}, "background"),
])
def test_bad_responses_are_400s_naming_the_field(oai, server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model=MODEL, max_output_tokens=4, **kwargs)
    error = refused.value.response.json()
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"] == param
    assert refused.value.param == param
    assert respond(oai, input=LONG, max_output_tokens=2).status == "incomplete"  # still serving


def test_an_unknown_previous_response_is_a_404(oai):
    with pytest.raises(openai.NotFoundError) as missing:
        respond(oai, input="And then?", previous_response_id="resp_unknown", max_output_tokens=4)
    assert missing.value.param == "previous_response_id" and "resp_unknown" in missing.value.body["message"]
    assert respond(oai, input=LONG, max_output_tokens=2).status == "incomplete"


# --- Messages -------------------------------------------------------------------------------------------------------

def test_a_message_is_the_chat_completion_of_its_messages(claude, oai):
    reply = message(claude, system=INSTRUCTIONS, messages=[{"role": "user", "content": SHORT}], max_tokens=30)
    completion = chat(oai, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": SHORT}],
                      max_tokens=30)
    assert completion.choices[0].finish_reason == "stop"
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == completion.choices[0].message.content and reply.content[0].text
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == completion.usage.prompt_tokens
    assert usage.output_tokens == completion.usage.completion_tokens


def test_a_streamed_message_is_the_whole_one(claude):
    kwargs = dict(model=MODEL, system=INSTRUCTIONS, messages=[{"role": "user", "content": SHORT}], max_tokens=30,
                  extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    wire = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
    n = wire.count("content_block_delta")
    assert n >= 1 and wire == ["message_start", "content_block_start"] + ["content_block_delta"] * n + [
        "content_block_stop", "message_delta", "message_stop"]
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert deltas == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence) == ("end_turn", None)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_a_forced_tool_use_and_its_result(claude, oai):
    ask = {"role": "user", "content": ASK}
    first = message(claude, messages=[ask], tools=ANTHROPIC_TOOLS, max_tokens=100,
                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    [use] = first.content
    assert use.name in PARAMETERS and isinstance(use.input, dict) and use.id
    jsonschema.validate(use.input, PARAMETERS[use.name])
    result = "21 degrees celsius, sunny"
    history = [ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    second = message(claude, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=40)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    completion = chat(oai, [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": result}], tools=CHAT_TOOLS, max_tokens=40)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == completion.usage.prompt_tokens
    texts = "".join(b.text for b in second.content if b.type == "text")
    assert (texts or None) == completion.choices[0].message.content


def test_stop_sequences_cut_the_greedy_text(claude):
    ask = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    unstopped = message(claude, messages=ask, max_tokens=30).content[0].text
    words = unstopped.split()
    assert len(words) >= 4, unstopped
    sequence = " " + words[3]
    expected = unstopped[:unstopped.index(sequence)]
    assert expected
    stopped = message(claude, messages=ask, max_tokens=30, stop_sequences=["@@never@@", sequence])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
    assert [(b.type, b.text) for b in stopped.content] == [("text", expected)]
    with claude.messages.stream(model=MODEL, messages=ask, max_tokens=30, stop_sequences=[sequence],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", sequence, expected)


def test_count_tokens_is_transformers_rendering(claude, hf_qwen_tokenizer):
    arguments = {"city": "Paris", "unit": "celsius"}
    conversation = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                           "input": arguments}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "21 °C, sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]
    counted = claude.messages.count_tokens(model=MODEL, system=INSTRUCTIONS, messages=conversation,
                                           tools=ANTHROPIC_TOOLS)
    theirs = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, sunny"},
              {"role": "user", "content": "And tomorrow?"}]
    ids = hf_qwen_tokenizer.apply_chat_template(theirs, tools=CHAT_TOOLS,
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    assert counted.input_tokens == len(ids)
    # without tools or system: the template's default system prompt
    plain = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": SHORT}])
    ids = hf_qwen_tokenizer.apply_chat_template([{"role": "user", "content": SHORT}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    assert plain.input_tokens == len(ids)


def test_the_api_key(server, claude):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": LONG}]}
    wrong = anthropic.Anthropic(base_url=server, api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**body)
    assert refused.value.status_code == 401
    error = refused.value.response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "authentication_error" and error["error"]["message"]
    for headers in ({}, {"authorization": "Bearer not-the-key"}, {"x-api-key": "not-the-key"}):
        response = httpx.post(f"{server}/v1/messages", json=body, headers=headers, timeout=60)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    # OpenAI's header on Anthropic's path, and the right x-api-key
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        response = httpx.post(f"{server}/v1/messages", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["stop_reason"] == "max_tokens"
    # on OpenAI's paths, a wrong key is a 401 in OpenAI's shape
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=f"{server}/v1", api_key="not-the-key", max_retries=0).responses.create(
            model=MODEL, input=SHORT, max_output_tokens=2)
    assert refused.value.status_code == 401 and refused.value.body["type"] == "authentication_error"


@pytest.mark.parametrize("kwargs, status, kind, named", [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     400, "invalid_request_error", "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": SHORT}], "max_tokens": 0}, 400, "invalid_request_error",
     "max_tokens"),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": SHORT}]},
     400, "invalid_request_error", "messages[0].role"),
    ({"messages": [{"role": "user", "content": SHORT}], "model": "no-such-model"}, 404, "not_found_error",
     "no-such-model"),
    ({"messages": [{"role": "user", "content": SHORT}, {"role": "assistant", "content": "The capital is"}]},
     400, "invalid_request_error", "messages[1]"),
])
def test_bad_messages_are_anthropic_errors_naming_the_field(claude, kwargs, status, kind, named):
    kwargs = {"model": MODEL, "max_tokens": 4, **kwargs}
    with pytest.raises(anthropic.APIStatusError) as refused:
        claude.messages.create(**kwargs)
    assert refused.value.status_code == status
    error = refused.value.response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind and named in error["error"]["message"], error
    assert message(claude, messages=[{"role": "user", "content": LONG}], max_tokens=2).stop_reason == "max_tokens"


# --- the OpenAI Agents SDK ------------------------------------------------------------------------------------------

def test_an_agents_sdk_turn_runs_the_tool(server):
    from agents import (
        Agent, ModelSettings, OpenAIResponsesModel, Runner, ToolCallItem, ToolCallOutputItem, function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is 21 degrees celsius and sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=600)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=100,
                                               parallel_tool_calls=False))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(cities) == 1 and isinstance(cities[0], str) and "Paris" in cities[0]
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    [output] = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert output.output == f"It is 21 degrees celsius and sunny in {cities[0]}."
    assert isinstance(result.final_output, str) and result.final_output.strip()
