"""The OpenAI-compatible server, in process on loopback, driven by the official `openai` client and httpx.

The engine underneath runs the real SmolLM2 in float32, so greedy output is the engine's (which the engine
tests check against transformers) whatever else shares the batch.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import jinja2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from helpers.browser import CHROMIUM, render_page
from helpers.chat import NO_THINKING, QWEN3_STYLE_TEMPLATE
from helpers.server import serving

from kvlm.engine.engine import Engine
from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams
from kvlm.server.app import create_app

MODEL = "smollm2-test"
API_KEY = "sk-test-key"
N_CTX = 4096
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, n_ctx=N_CTX, max_num_seqs=16)


@pytest.fixture(scope="module")
def server(engine):
    """Base URL of a server on a thread; the engine is shut down with it."""
    with serving(create_app(engine, MODEL, API_KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server: str, path: str, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server}{path}", content=content, timeout=120,
                      headers={"content-type": "application/json", **headers})


def kv_state(server: str) -> dict:
    return httpx.get(f"{server}/kv", timeout=30).json()


def wait_until_no_request_cells(server: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        kv = kv_state(server)
        if kv["n_request_cells"] == 0 or time.monotonic() > deadline:
            return kv
        time.sleep(0.1)


# --- the openai client ---

def test_completion_matches_the_engine_and_counts_usage(client, smollm2):
    prompt = "The three primary colours are"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    expected = LLM(smollm2, n_ctx=512, max_num_seqs=1).generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(smollm2.tokenizer.encode(prompt))
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.model == MODEL and out.object == "text_completion"


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time, in a small village,", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_streamed_equals_whole_and_uses_the_chat_template(client, smollm2):
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Name a large animal that lives in the sea."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    template_ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(messages),
                                            add_special_tokens=False)
    assert whole.usage.prompt_tokens == len(template_ids)
    expected = LLM(smollm2, n_ctx=512, max_num_seqs=1).generate(
        [template_ids], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)[0]
    assert whole.choices[0].message.content == expected.text


def test_n_choices_with_a_seed_are_reproducible(client):
    kwargs = dict(model=MODEL, prompt="My favourite fruit is", max_tokens=10, temperature=1.0, n=3, seed=7,
                  logprobs=0)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice samples with its own seed
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)


def test_n_choices_stream_each_index_to_its_end(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0, n=2,
        stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and texts[0] == texts[1] != ""  # greedy: both choices agree


def test_stop_string_ends_the_text_before_it(client):
    kwargs = dict(model=MODEL, prompt="Count with me: one, two, three, four,", max_tokens=20, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(stop)]


def test_completion_logprobs(client, smollm2):
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_streamed_logprobs_equal_the_whole_ones(client):
    # The stop string makes the stream hold text back after every comma: offsets must not drift.
    kwargs = dict(model=MODEL, prompt="Count with me: one, two, three, four,", max_tokens=8, temperature=0,
                  logprobs=2, stop=[",QQQ"])
    whole = client.completions.create(**kwargs).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [x for lp in streamed for x in lp.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-6)
    assert [x for lp in streamed for x in lp.text_offset] == whole.text_offset


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8") == out.choices[0].message.content


def test_wrong_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# --- bad input ---

LONG_PROMPT = "word " * (N_CTX + 10)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BAD_REQUESTS = [
    # (path, body, headers, status, param, words in the message)
    ("/v1/completions", '{"model": "x", "prompt": ', AUTH, 400, None, ["JSON"]),
    ("/v1/completions", {"model": MODEL}, AUTH, 400, "prompt", ["prompt"]),
    ("/v1/chat/completions", {"model": MODEL}, AUTH, 400, "messages", ["messages"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, AUTH, 400, "max_tokens", ["integer"]),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, AUTH, 400, "prompt", []),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, AUTH, 404, "model", ["gpt-4o"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, AUTH, 400, "max_tokens", ["-1"]),
    ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, AUTH, 400, "prompt", [str(N_CTX), "prompt has"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": N_CTX}, AUTH, 400, "max_tokens",
     [str(N_CTX), "in the prompt"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, AUTH, 400, "max_completion_tokens", ["0"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, AUTH, 400, "temperature", ["-1"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, AUTH, 400, "top_p", ["top_p"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, AUTH, 400, "n", ["n"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, AUTH, 400, "best_of", ["best_of"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "frobnicate": True}, AUTH, 400, "frobnicate",
     ["frobnicate"]),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, AUTH, 400, "prompt", [str(10**9)]),
    ("/v1/completions", {"model": MODEL, "prompt": [[5, 6], []]}, AUTH, 400, "prompt", ["empty"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, AUTH, 400, "logit_bias",
     ["abc"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, AUTH, 400, "messages", []),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, AUTH, 400,
     "messages.0.role", []),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, AUTH, 400, "tools.0.function", ["function"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [TOOL]}, AUTH, 400, "tools", ["no tool-call format", "required"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": "required"}, AUTH, 400, "tool_choice", ["`tools` must be set"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, AUTH, 400,
     "tool_choice", ["'nope'", "get_weather"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, AUTH, 400,
     "tools", ["cannot be combined with tools"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                  "type": "nosuch"}}}}, AUTH, 400, "response_format", ["json", "nosuch"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, AUTH, 400, "response_format.type", []),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, AUTH, 400, "response_format",
     ["json_schema.schema"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "(", "guided_choice": ["a"]}, AUTH, 400,
     "guided_choice", ["at most one", "guided_regex", "guided_choice"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "("}}, AUTH, 400,
     "structured_outputs", ["regex", "unclosed group"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "grammar": "root ::= foo"}, AUTH, 400, "grammar",
     ["grammar"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"choice": "yes"}}, AUTH, 400,
     "structured_outputs", ["choice", "list"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, AUTH, 400,
     "messages", ["needs content"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 3}, AUTH, 400, "top_logprobs", ["logprobs"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": "enable_thinking"}, AUTH, 400, "chat_template_kwargs",
     ["dictionary", "enable_thinking"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"messages": []}}, AUTH, 400, "chat_template_kwargs",
     ["cannot set messages"]),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}, AUTH, 400,
     "chat_template_kwargs", ["dictionary"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, {"Authorization": "Bearer nope"}, 401, None, ["API key"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, {}, 401, None, ["API key"]),
    ("/detokenize", {"tokens": [-5]}, AUTH, 400, "tokens", ["-5"]),
    ("/tokenize", {}, AUTH, 400, "prompt", []),
    ("/v1/completions", "[1, 2]", AUTH, 400, None, ["object"]),
    ("/v1/completions", "", AUTH, 400, None, ["JSON object"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, AUTH, 400, "logit_bias",
     ["99999999"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, AUTH, 400, "logprobs", ["20"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, AUTH, 400, "stop",
     ["4"]),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": "x" * 100_000}, AUTH, 400, "stop", ["256"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, AUTH, 400,
     "messages", [str(N_CTX)]),
]


@pytest.mark.parametrize("path, body, headers, status, param, words", BAD_REQUESTS,
                         ids=[f"{i}-{case[0]}-{case[3]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, path, body, headers, status, param,
                                                                     words):
    response = post(server, path, body, headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert all(word in error["message"] for word in words), error["message"]
    assert "Traceback" not in response.text
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_a_failing_forward_pass_fails_its_requests_and_the_server_keeps_serving(server, engine, monkeypatch):
    decoder = engine.model.decoder
    forward = decoder.forward
    calls = {"n": 0}

    def fails_on_the_third_call(*args, **kwargs):  # the request has cells and tokens by then
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    monkeypatch.setattr(decoder, "forward", fails_on_the_third_call)
    before = scrape(server)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert message.startswith("the engine failed: EngineError") and "injected failure" in message
    assert kv_state(server)["n_request_cells"] == 0
    assert scrape(server)["kvlm_requests_total{finish_reason=error}"] - before.get(
        "kvlm_requests_total{finish_reason=error}", 0) == 1
    calls["n"] = 0
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=60) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(line[6:]) for line in lines[:-1] if "error" in json.loads(line[6:])]
    assert len(errors) == 1 and "injected failure" in errors[0]["error"]["message"]
    assert lines[-1] == "data: [DONE]"
    monkeypatch.undo()
    assert kv_state(server)["n_request_cells"] == 0
    ok = post(server, "/v1/completions", body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_a_chat_template_that_refuses_the_messages_is_a_400(server, engine, monkeypatch):
    def refuse(*args, **kwargs):
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant")

    monkeypatch.setattr(engine.model.tokenizer, "apply_chat_template", refuse)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "roles must alternate" in error["message"]


def test_chat_template_kwargs_reach_the_template(server, client, engine, monkeypatch):
    """vLLM's extra field, as clients send it: the openai client's extra_body."""
    monkeypatch.setattr(engine.model.tokenizer, "chat_template", QWEN3_STYLE_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs, thinks in (None, True), ({"enable_thinking": True}, True), ({"enable_thinking": False}, False):
        expected = engine.model.tokenizer.encode_chat(messages, **(kwargs or {}))
        assert engine.model.tokenizer.decode(expected).endswith(NO_THINKING) != thinks
        tokens = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": kwargs}).json()
        assert tokens["tokens"] == expected
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                             extra_body={"chat_template_kwargs": kwargs})
        assert out.usage.prompt_tokens == len(expected)


def test_unknown_route_and_method_have_the_error_shape(server):
    assert httpx.get(f"{server}/v2/nothing").json()["error"]["message"]
    response = httpx.get(f"{server}/v1/completions", headers=AUTH)
    assert response.status_code == 405 and "error" in response.json()


# --- tokens, models, health ---

def test_tokenize_and_detokenize(server, smollm2):
    text = "Tokenize this, please: 12345!"
    tokens = post(server, "/tokenize", {"prompt": text}).json()
    assert tokens["tokens"] == smollm2.tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == N_CTX
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == \
        smollm2.tokenizer.decode(tokens["tokens"])
    messages = [{"role": "user", "content": "Hello"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(messages),
                                                      add_special_tokens=False)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


# --- metrics ---

def scrape(server: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server}/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_parse_and_count_what_was_sent(server, client, smollm2):
    before = scrape(server)
    prompts = ["Alpha beta gamma", "One two three four five"]
    for prompt in prompts:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(server)
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    assert delta("kvlm_requests_total{finish_reason=length}") == 2
    assert delta("kvlm_prompt_tokens_total") == sum(len(smollm2.tokenizer.encode(p)) for p in prompts)
    assert delta("kvlm_generation_tokens_total") == 6
    assert delta("kvlm_time_to_first_token_seconds_count") == 2
    assert delta("kvlm_inter_token_latency_seconds_count") == 4
    assert after["kvlm_kv_cells_total"] == N_CTX
    assert after["kvlm_requests_running"] == 0 and after["kvlm_requests_waiting"] == 0


def test_prefix_reuse_shows_in_metrics_and_usage(server, client):
    system = "You are a patient tutor. " * 12
    messages = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    client.chat.completions.create(model=MODEL, messages=messages("What is 2 + 2?"), max_tokens=2, temperature=0)
    before = scrape(server)
    out = client.chat.completions.create(model=MODEL, messages=messages("What is 3 + 3?"), max_tokens=2,
                                         temperature=0)
    after = scrape(server)
    hit_tokens = after["kvlm_prefix_cache_hit_tokens_total"] - before.get("kvlm_prefix_cache_hit_tokens_total", 0)
    assert after["kvlm_prefix_cache_hits_total"] - before.get("kvlm_prefix_cache_hits_total", 0) == 1
    assert hit_tokens >= 64
    assert out.usage.prompt_tokens_details.cached_tokens == hit_tokens  # OpenAI's field


# --- cancellation and load ---

async def stream_chat(http: httpx.AsyncClient, server: str, content: str, max_tokens: int,
                      leave_after: int | None) -> dict:
    """One streaming chat; leave_after: disconnect after that many content chunks."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    pieces, usage, done = 0, None, False
    async with http.stream("POST", f"{server}/v1/chat/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                pieces += 1
                if leave_after is not None and pieces >= leave_after:
                    break
            usage = chunk.get("usage") or usage
    return {"done": done, "usage": usage, "pieces": pieces}


def test_disconnect_mid_stream_frees_the_requests_cells(server):
    async def leave_early():
        async with httpx.AsyncClient(timeout=120) as http:
            return await stream_chat(http, server, "Tell me a very long story.", 2000, leave_after=3)

    before = scrape(server)
    result = asyncio.run(leave_early())
    assert not result["done"]
    kv = wait_until_no_request_cells(server)
    assert kv["n_request_cells"] == 0
    assert all(s["role"] == "prefix_cache" for s in kv["sequences"])
    after = scrape(server)
    assert after["kvlm_requests_total{finish_reason=abort}"] - before.get(
        "kvlm_requests_total{finish_reason=abort}", 0) == 1


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(server):
    before = scrape(server)
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=1.5)
    kv = wait_until_no_request_cells(server)
    assert kv["n_request_cells"] == 0
    after = scrape(server)
    assert after["kvlm_requests_total{finish_reason=abort}"] - before.get(
        "kvlm_requests_total{finish_reason=abort}", 0) == 1


def test_32_concurrent_streams_three_rounds_with_some_leaving(server):
    max_tokens = 12

    async def round_of(index: int) -> list[dict]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.gather(*(
                stream_chat(http, server, f"Round {index}, client {i}: write about the number {i * 7 + index}.",
                            max_tokens, leave_after=2 if i % 5 == 0 else None) for i in range(32)))

    for index in range(3):
        results = asyncio.run(round_of(index))
        for i, result in enumerate(results):
            if i % 5 == 0:
                assert not result["done"]
            else:
                assert result["done"] and result["usage"]["completion_tokens"] == max_tokens, (i, result)
    kv = wait_until_no_request_cells(server)
    assert kv["n_request_cells"] == 0
    assert kv["n_prefix_cache_only_cells"] > 0  # what is left is the prefix cache, reported apart
    assert all(s["role"] == "prefix_cache" for s in kv["sequences"])


# --- the live view in a real browser ---

@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: `make test` installs Debian's chromium when run as root")
def test_kv_view_draws_the_cells_of_a_running_request(server, tmp_path):
    stop = threading.Event()

    def long_request() -> None:
        body = {"model": MODEL, "prompt": "A long story begins here.", "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH, timeout=120) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while kv_state(server)["n_request_cells"] == 0:
            assert time.monotonic() < deadline, "the request never got cells"
            time.sleep(0.05)
        url = f"{server}/kv/view"
        dom, shot = render_page(tmp_path, url, 800)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert 'data-request-cells="' in dom and 'data-request-cells="0"' not in dom
    running = [line for line in dom.split("<li") if "· request cmpl-" in line]
    assert running, dom[-2000:]
    assert "<canvas" in dom and '<div id="error"></div>' in dom  # drawn, and no fetch error shown
    image = shot.read_bytes()
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and len(image) > 5000
