"""One answer per greedy request through the engine and the server, on the real SmolLM2 and Qwen2.5-Coder-0.5B in
kvlm's default mode: the same chat prompts give the same tokens with the prefix cache or without it, asked alone,
asked again, asked all at once in prompt chunks of 32 tokens, and with speculative guesses; on a live server the
same request gives the same text whole, streamed, and while other requests run beside it, and a forced tool call
streamed gives the same call as answered whole."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers.models import load_on
from helpers.server import serving

from kvlm import LLM, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.loader.load import load_model
from kvlm.server.app import create_app

QUESTIONS = ["Name three rivers in Europe.", "What is a KV cache, in two sentences?",
             "Write a Python function that reverses a string.", "Why is the sky blue?"]
CONVERSATIONS = [[{"role": "user", "content": question}] for question in QUESTIONS]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def answers(llm: LLM, together: bool = False) -> list[list[int]]:
    if together:
        return [out.token_ids for out in llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)]
    return [llm.chat([conversation], GREEDY, use_tqdm=False)[0].token_ids for conversation in CONVERSATIONS]


@pytest.mark.parametrize("name,ops", [("smollm2", "native"), ("qwen", "native"), ("smollm2", "torch")])
def test_greedy_answers_do_not_depend_on_the_cache_or_the_batch(name, ops, smollm2_gguf_path, qwen_gguf_path):
    """With kvlm's native kernels, and with torch's ops alone (no compiler)."""
    model = load_on(smollm2_gguf_path if name == "smollm2" else qwen_gguf_path, ops == "native")
    reference = answers(LLM(model, n_ctx=1024, enable_prefix_caching=False))
    cached = LLM(model, n_ctx=1024)
    assert answers(cached) == reference  # each prompt's template prefix from the prefix cache
    assert answers(cached) == reference  # asked again: all but the last token of each prompt cached
    assert answers(LLM(model, n_ctx=1024, max_num_batched_tokens=32), together=True) == reference  # chunks of 32
    speculative = LLM(model, n_ctx=1024, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert answers(speculative, together=True) == reference


@pytest.fixture(scope="module")
def client(smollm2_gguf_path):
    engine = Engine(load_model(str(smollm2_gguf_path), progress=False), n_ctx=2048, max_num_seqs=8)
    with serving(create_app(engine, "smollm2")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def ask(client, messages, stream: bool = False) -> str:
    response = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=32,
                                              stream=stream)
    if not stream:
        return response.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)


def test_the_server_gives_one_text_whole_streamed_and_beside_others(client):
    question = CONVERSATIONS[1]
    whole = ask(client, question)
    assert ask(client, question, stream=True) == whole
    assert ask(client, question) == whole  # again: now from the prefix cache
    with ThreadPoolExecutor(4) as pool:  # beside three other requests, in the same steps
        others = [pool.submit(ask, client, other, True) for other in CONVERSATIONS[:1] + CONVERSATIONS[2:]]
        beside = pool.submit(ask, client, question)
        assert beside.result() == whole
        assert all(other.result() for other in others)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}


def call_tool(client, stream: bool) -> tuple[str, dict]:
    response = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What will the weather be in Oslo this week?"}],
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64, stream=stream)
    if not stream:
        [call] = response.choices[0].message.tool_calls
        return call.function.name, json.loads(call.function.arguments)
    name, arguments = "", ""
    for chunk in response:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name += delta.function.name or ""
            arguments += delta.function.arguments or ""
    return name, json.loads(arguments)


def test_a_streamed_tool_call_equals_the_whole_one(client):
    whole = call_tool(client, stream=False)
    assert whole[0] == "get_weather" and set(whole[1]) == {"city", "days"}
    assert call_tool(client, stream=True) == whole
