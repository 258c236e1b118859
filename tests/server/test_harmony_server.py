"""gpt-oss's harmony output through the server and LLM.chat, end to end, on a tiny random Llama whose vocabulary has
harmony's special tokens and whose chat template is gpt-oss's (tests/helpers/harmony_factory.py).

A random model writes no harmony, so each test scripts the output: every step's logits are replaced by ones that
favour the script's next token and go through the request's real sampler, so a constraint's mask, the stop tokens
and the detokenization apply as to any output (a mask that refused a scripted token would change the output). The
scripts are written as gpt-oss writes (see test_harmony_output.py); the last token is the stop token the model ends
its turn with, <|call|> after a call and <|return|> after an answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import torch
from helpers.harmony_factory import N_CTX, write_harmony_gguf
from helpers.server import serving

from kvlm.engine.engine import Engine
from kvlm.engine.llm import LLM
from kvlm.sampling.sampler import RequestSampler
from kvlm.sampling.params import SamplingParams
from kvlm.loader.load import load_model
from kvlm.server.app import create_app

MODEL = "gpt-oss-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
ANSWER = "<|channel|>final<|message|>It is sunny in Paris."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(write_harmony_gguf(tmp_path_factory.mktemp("harmony") / "tiny.gguf")), "float32",
                      progress=False)


@pytest.fixture(scope="module")
def server(model):
    with serving(create_app(Engine(model, n_ctx=N_CTX, max_num_seqs=2), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)


@dataclass
class Script:
    ids: list[int] = field(default_factory=list)  # what every request writes
    prompts: list[list[int]] = field(default_factory=list)  # each request's prompt
    masked: list[bool] = field(default_factory=list)  # per sampled token: whether a constraint masked the step


@pytest.fixture
def script(monkeypatch, model) -> Script:
    state = Script()
    init, sample = RequestSampler.__init__, RequestSampler.sample

    def recording_init(self, params, prompt_token_ids):
        init(self, params, prompt_token_ids)
        state.prompts.append(list(prompt_token_ids))
        self.scripted = 0

    def scripted_sample(self, logits, allowed=None):
        favoured = torch.full_like(logits, -30.0)
        favoured[state.ids[self.scripted]] = 30.0
        self.scripted += 1
        state.masked.append(allowed is not None)
        return sample(self, favoured, allowed)

    monkeypatch.setattr(RequestSampler, "__init__", recording_init)
    monkeypatch.setattr(RequestSampler, "sample", scripted_sample)
    return state


def write(script: Script, model, text: str) -> None:
    script.ids = model.tokenizer.encode(text, add_special_tokens=False)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, **kwargs).choices[0]


def whole(client, **kwargs) -> tuple:
    """(reasoning_content, content, [(name, arguments)], finish_reason) of a response."""
    choice = chat(client, **kwargs)
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
    return choice.message.model_extra.get("reasoning_content"), choice.message.content, calls, choice.finish_reason


def streamed(client, **kwargs) -> tuple:
    """The same, assembled from a stream's deltas as a client does."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:
                calls[part.index] = [part.function.name, ""]
            calls[part.index][1] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning or None, content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tools_auto_reads_the_call_whole_and_streamed(client, model, script):
    write(script, model, ANALYSIS + CALL + "<|call|>")
    expected = ("Need the weather.", None, [("get_weather", '{"city": "Paris"}')], "tool_calls")
    assert whole(client, tools=TOOLS, max_tokens=100) == expected
    assert streamed(client, tools=TOOLS, max_tokens=100) == expected
    # "auto" leaves the output free until a header names a function (the recipient written whole); the rest of the
    # call, from its arguments on, is the tools' grammar's (kvlm.tool_calls.tool_choice)
    opened = len(model.tokenizer.encode(ANALYSIS + CALL.split("get_weather")[0], add_special_tokens=False))
    arguments = len(model.tokenizer.encode('{"city":"Paris"}<|call|>', add_special_tokens=False))
    for masked in (script.masked[:len(script.ids)], script.masked[len(script.ids):]):  # whole, then streamed
        assert not any(masked[:opened]) and all(masked[-arguments:])


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
def test_a_final_answer_after_analysis_whole_and_streamed(client, model, script, tools):
    write(script, model, ANALYSIS + ANSWER + "<|return|>")
    expected = ("Need the weather.", "It is sunny in Paris.", [], "stop")
    assert whole(client, tools=tools or openai.omit, max_tokens=100) == expected
    assert streamed(client, tools=tools or openai.omit, max_tokens=100) == expected


def test_reasoning_cut_by_max_tokens_is_reasoning_without_content(client, model, script):
    write(script, model, ANALYSIS + ANSWER + "<|return|>")
    reasoning, content, calls, finish = whole(client, max_tokens=10)  # the header is 6 tokens
    assert finish == "length" and content is None and calls == []
    assert reasoning and "Need the weather.".startswith(reasoning)
    assert streamed(client, max_tokens=10) == (reasoning, content, calls, finish)


@pytest.mark.parametrize("tool_choice, finish", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")])
def test_a_forced_call_is_masked_from_the_first_token(client, model, script, tool_choice, finish):
    """The grammar covers the analysis too: every token of the output goes through its mask, and the scripted
    output, gpt-oss's own form, passes it whole."""
    write(script, model, ANALYSIS + CALL + "<|call|>")
    assert whole(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=100) == (
        "Need the weather.", None, [("get_weather", '{"city": "Paris"}')], finish)
    assert len(script.masked) == len(script.ids) and all(script.masked)


def test_a_response_format_constrains_the_final_message_only(client, model, script):
    """The analysis is free; the mask starts with the final message's body (vLLM: after ...final<|message|>)."""
    write(script, model, ANALYSIS + '<|channel|>final<|message|>{"sky": "sunny"}<|return|>')
    assert whole(client, max_tokens=100, response_format={"type": "json_object"}) == (
        "Need the weather.", '{"sky": "sunny"}', [], "stop")
    body_start = len(model.tokenizer.encode(ANALYSIS + "<|channel|>final<|message|>", add_special_tokens=False))
    assert not any(script.masked[:body_start]) and all(script.masked[body_start:])


def test_reasoning_effort_reaches_the_template(client, server, model, script):
    write(script, model, ANSWER + "<|return|>")
    chat(client, max_tokens=3, reasoning_effort="high")
    assert "\nReasoning: high\n" in model.tokenizer.decode(script.prompts[-1])
    chat(client, max_tokens=3)
    assert "\nReasoning: medium\n" in model.tokenizer.decode(script.prompts[-1])  # the template's default
    for body, words in (({"reasoning_effort": "extreme"}, ["'extreme'", "low, medium, high"]),
                        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                         ["'low'", "'high'"])):
        response = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={"messages": ASK, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "reasoning_effort" and all(word in error["message"] for word in words), error


def test_llm_chat_returns_the_call_and_keeps_the_markers_in_the_text(model, script):
    write(script, model, ANALYSIS + CALL + "<|call|>")
    llm = LLM(model, n_ctx=N_CTX, max_num_seqs=1)
    out = llm.chat(ASK, SamplingParams(max_tokens=100, temperature=0), use_tqdm=False, tools=TOOLS)[0]
    assert out.text == ANALYSIS + CALL and out.finish_reason == "tool_calls"
    assert out.message["reasoning_content"] == "Need the weather." and out.message["content"] is None
    [call] = out.message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
