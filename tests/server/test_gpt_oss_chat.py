"""gpt-oss's chat template (OpenAI's "harmony" format) rendered by kvlm exactly as transformers renders it.

The reference is transformers' `PreTrainedTokenizerFast.apply_chat_template(..., tokenize=False)` given the same
template string; no expected prompt is written by hand. kvlm renders it from a GGUF's `tokenizer.chat_template`
(metadata, and a real file through `load_model`), from a folder's chat_template.jinja (how openai/gpt-oss-20b ships
it), and from an OpenAI-style server request.

tests/data/gpt-oss-chat-template.jinja is, byte for byte, ggml-org/llama.cpp's
models/templates/openai-gpt-oss-120b.jinja as last changed by commit b204a5a234f4cf0b3f449476da639a5510c6d157
("gpt-oss: implement harmony parsing (#15181)") and unchanged up to upstream commit
d8a24ccee207a1ff24c513fe1c7d3222b3ccd837 (2026-06-13); it was read from a fork carrying that upstream history
(Raudbjorn/ggml-llama.cpp). It is also byte for byte openai/gpt-oss-20b's chat_template.jinja as of that repository's
commit cbf31f62664d4b1360b3a78427f7b3c3ed8f0fa8 ("Update chat_template.jinja (#94)"). sha256 below.

The template writes "Current date: " + strftime_now("%Y-%m-%d"), so most tests pin the clock of both renderers to
one instant; one test leaves it running and checks that both write today's date.
"""
from __future__ import annotations

import copy
import hashlib
from datetime import date, datetime

import jinja2
import pytest
import transformers.utils.chat_template_utils

import kvlm.text.tokenizer
from helpers import DATA
from helpers.gguf_factory import (
    BOS_ID, SPECIAL_TOKENS, byte_level_tokenizer, gguf_metadata, gguf_tensors, llama_config, random_llama,
    template_folder_tokenizers, write_gguf,
)
from kvlm import LLM, SamplingParams, load_model
from kvlm.server.chat_turn import chat_prompt
from kvlm.server.protocol import ChatCompletionRequest
from kvlm.text.tokenizer import Tokenizer

TEMPLATE_PATH = DATA / "gpt-oss-chat-template.jinja"
TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"
# read_bytes + decode, not read_text: universal newlines would hide a stray \r
TEMPLATE = TEMPLATE_PATH.read_bytes().decode("utf-8")
PINNED = datetime(2025, 8, 5, 23, 59, 30)  # gpt-oss's release day, late enough that a running clock would differ

# Every branch of the template's render_typescript_type: enums with a default, numbers, booleans, arrays of
# scalars and of objects, nested objects with optional fields, a list of types, oneOf with descriptions, nullable.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "description": "How many days", "default": 1},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "stations": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "string"}}}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat"]},
        "note": {"type": ["string", "null"]},
        "at": {"oneOf": [{"type": "string", "description": "ISO time"}, {"type": "integer"}]},
        "label": {"type": "string", "nullable": True},
    }, "required": ["city", "days"]}}}
NOOP = {"type": "function", "function": {"name": "noop", "description": "Does nothing"}}  # no parameters
TOOLS = [WEATHER, NOOP]

USER = {"role": "user", "content": "Écris un haïku sur la mer. 🌊"}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "fields": ["wind"]}}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Zürich for two days?"},
    # content None, as OpenAI clients send it: transformers drops None values, and so must kvlm
    {"role": "assistant", "content": None, "reasoning_content": "I need the forecast.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "sunny <b>&</b>"}'},
]

# name: (messages, add_generation_prompt, tools, template kwargs)
CONVERSATIONS = {
    "user only": ([USER], True, None, {}),
    "user only, no generation prompt": ([USER], False, None, {}),
    "system and user": ([{"role": "system", "content": "Answer in French."}, USER], True, None, {}),
    "developer and user": ([{"role": "developer", "content": "Be brief."}, USER], True, None, {}),
    # An earlier turn's reasoning is dropped; the template reads `thinking`, which transformers fills from any name.
    "earlier thinking is dropped": ([
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "thinking": "Simple sum."},
        {"role": "user", "content": "And 3 + 3?"},
    ], True, None, {}),
    "last turn's reasoning_content is rendered": ([
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Add."},
    ], False, None, {}),
    "last turn's reasoning (vLLM's name) is rendered": ([
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4", "reasoning": "Add."},
    ], False, None, {}),
    "tool call and result": (TOOL_TURNS, True, TOOLS, {}),
    "tool call, result and final answer": (TOOL_TURNS + [
        {"role": "assistant", "content": "21 °C and sunny."}, {"role": "user", "content": "Thanks!"},
    ], True, TOOLS, {}),
    "tool call with its analysis in content": ([
        TOOL_TURNS[0], {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]}, TOOL_TURNS[2],
    ], True, TOOLS, {}),
    "tools with developer instructions": ([{"role": "developer", "content": "Use tools."}, USER], True, TOOLS, {}),
    "reasoning effort and identity": ([{"role": "system", "content": "Answer in French."}, USER], True, None,
                                      {"reasoning_effort": "high", "model_identity": "You are a terse assistant."}),
    "builtin tools": ([USER], True, [WEATHER], {"builtin_tools": ["browser", "python"], "reasoning_effort": "low"}),
}
# The template's raise_exception checks, which must fail the same way in both.
REFUSED = {
    "channel tags in content": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<|channel|>final<|message|>Hello"},
        {"role": "user", "content": "Again"},
    ],
    "tool result without a call": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}],
    "content and thinking beside a call": [
        TOOL_TURNS[0], {"role": "assistant", "content": "Look.", "thinking": "Hm.", "tool_calls": [CALL]},
    ],
}


@pytest.fixture(scope="module")
def reference_tokenizer():
    return byte_level_tokenizer(1000)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """kvlm's tokenizer built from GGUF metadata carrying the template, as a file's metadata reaches it."""
    return Tokenizer.from_gguf_metadata({**gguf_metadata(llama_config()), "tokenizer.chat_template": TEMPLATE})


class _PinnedClock(datetime):
    @classmethod
    def now(cls, tz=None):
        return PINNED


@pytest.fixture
def pinned_clock(monkeypatch):
    """Both renderers' strftime_now read `datetime` from their module when called; the same fixed instant for both."""
    monkeypatch.setattr(kvlm.text.tokenizer, "datetime", _PinnedClock)
    monkeypatch.setattr(transformers.utils.chat_template_utils, "datetime", _PinnedClock)


def reference(hf_tokenizer, messages, add_generation_prompt, tools=None, **kwargs) -> str:
    # deep copies: neither renderer may see the other's edits (both add reasoning aliases to their own copies)
    return hf_tokenizer.apply_chat_template(
        copy.deepcopy(messages), tools=copy.deepcopy(tools), chat_template=TEMPLATE, tokenize=False,
        add_generation_prompt=add_generation_prompt, **kwargs)


def test_the_template_file_is_the_published_one():
    assert hashlib.sha256(TEMPLATE_PATH.read_bytes()).hexdigest() == TEMPLATE_SHA256
    assert "strftime_now" in TEMPLATE and "<|start|>" in TEMPLATE


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_matches_transformers(tokenizer, reference_tokenizer, pinned_clock, name):
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
    expected = reference(reference_tokenizer, messages, add_generation_prompt, tools, **kwargs)
    assert "Current date: 2025-08-05\n" in expected  # the pinned clock reached transformers' strftime_now
    assert tokenizer.apply_chat_template(
        copy.deepcopy(messages), add_generation_prompt, copy.deepcopy(tools), **kwargs) == expected


def test_conversations_reach_the_branches_they_name(reference_tokenizer, pinned_clock):
    """Guards the cases above against a template or input change that would make them test nothing."""
    def render(name):
        return reference(reference_tokenizer, *CONVERSATIONS[name][:3], **CONVERSATIONS[name][3])

    analysis = "<|channel|>analysis<|message|>"
    assert render("earlier thinking is dropped").count(analysis) == 0
    assert analysis + "Add.<|end|>" in render("last turn's reasoning_content is rendered")
    assert analysis + "Add.<|end|>" in render("last turn's reasoning (vLLM's name) is rendered")
    call = render("tool call and result")
    assert analysis + "I need the forecast.<|end|>" in call and "to=functions.get_weather" in call
    assert "<|start|>functions.get_weather to=assistant" in call and "type noop = () => any;" in call
    assert analysis not in render("tool call, result and final answer")
    assert analysis + "Let me look.<|end|>" in render("tool call with its analysis in content")
    assert "Reasoning: high" in render("reasoning effort and identity")
    assert "## browser" in render("builtin tools") and "## python" in render("builtin tools")


@pytest.mark.parametrize("name", REFUSED)
def test_refuses_as_transformers_does(tokenizer, reference_tokenizer, name):
    with pytest.raises(jinja2.TemplateError) as theirs:
        reference(reference_tokenizer, REFUSED[name], True, TOOLS)
    with pytest.raises(jinja2.TemplateError) as ours:
        tokenizer.apply_chat_template(copy.deepcopy(REFUSED[name]), True, TOOLS)
    assert str(ours.value) == str(theirs.value)


def test_the_date_is_today_as_in_transformers(tokenizer, reference_tokenizer):
    """Unpinned, both write the local date; rendered again if midnight passed between the two."""
    for _ in range(2):
        today = date.today()
        expected = reference(reference_tokenizer, [USER], True)
        ours = tokenizer.apply_chat_template([USER])
        if date.today() == today:
            break
    assert ours == expected and f"Current date: {today.isoformat()}\n" in ours


def test_a_folders_chat_template_jinja(tmp_path, pinned_clock):
    """openai/gpt-oss-20b ships the template as chat_template.jinja; kvlm and transformers each read the folder."""
    ours, from_folder = template_folder_tokenizers(tmp_path, TEMPLATE_PATH.read_bytes())
    assert ours.chat_template == from_folder.chat_template == TEMPLATE
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS["tool call and result"]
    assert ours.apply_chat_template(copy.deepcopy(messages), add_generation_prompt, tools, **kwargs) == \
        from_folder.apply_chat_template(copy.deepcopy(messages), tools=tools, tokenize=False,
                                        add_generation_prompt=add_generation_prompt, **kwargs)


def test_an_openai_request_renders_as_transformers_renders_its_messages(tokenizer, reference_tokenizer,
                                                                        pinned_clock):
    """The server's path: arguments as a JSON string, content null and reasoning_content, as OpenAI clients send
    them, give the prompt transformers makes of the same turns written its way (arguments as an object)."""
    body = ChatCompletionRequest.model_validate({
        "messages": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": TOOL_TURNS[0]["content"]},
            {"role": "assistant", "content": None, "reasoning_content": "I need the forecast.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Zürich", "days": 2, "fields": ["wind"]}'}}]},
            TOOL_TURNS[2],
        ],
        "tools": TOOLS,
        "chat_template_kwargs": {"reasoning_effort": "low"},
    })
    expected = reference(reference_tokenizer, [{"role": "developer", "content": "Use tools."}, *TOOL_TURNS], True,
                         TOOLS, reasoning_effort="low")
    assert chat_prompt(tokenizer, body, body.tool_dicts()) == expected


# --- a GGUF file carrying the template, through the public API ---

@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """A tiny random Llama whose GGUF metadata carries the gpt-oss template (the family does not matter here)."""
    config = llama_config()
    config.max_position_embeddings = 1024  # the harmony system header alone is a few hundred byte-level tokens
    metadata = {**gguf_metadata(config), "tokenizer.chat_template": TEMPLATE}
    path = write_gguf(tmp_path_factory.mktemp("gpt-oss-template") / "tiny.gguf", metadata,
                      gguf_tensors(random_llama(config)))
    return load_model(str(path), "float32", progress=False)


def test_the_file_keeps_the_template_byte_for_byte(gguf_model):
    assert gguf_model.tokenizer.chat_template == TEMPLATE


@pytest.mark.parametrize("name", ["developer and user", "tool call and result", "reasoning effort and identity"])
def test_a_gguf_file_renders_as_transformers(gguf_model, reference_tokenizer, pinned_clock, name):
    messages, add_generation_prompt, tools, kwargs = CONVERSATIONS[name]
    expected = reference(reference_tokenizer, messages, add_generation_prompt, tools, **kwargs)
    assert gguf_model.tokenizer.apply_chat_template(
        copy.deepcopy(messages), add_generation_prompt, copy.deepcopy(tools), **kwargs) == expected


def test_llm_chat_forwards_reasoning_effort(gguf_model, reference_tokenizer, pinned_clock, one_thread):
    """LLM.chat's chat_template_kwargs reach the template: the prompt it runs is transformers' rendering."""
    messages = [{"role": "system", "content": "Answer in French."}, USER]
    llm = LLM(gguf_model, n_ctx=1024, max_num_seqs=1)
    out = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False,
                   chat_template_kwargs={"reasoning_effort": "low"})[0]
    expected = reference(reference_tokenizer, messages, True, reasoning_effort="low")
    assert "Reasoning: low\n" in expected
    assert out.prompt_token_ids == reference_tokenizer.encode(expected, add_special_tokens=False)


def test_the_reference_tokenizer_is_the_files_vocabulary(reference_tokenizer, gguf_model):
    """The last test compares token ids with the reference tokenizer's; they share one vocabulary."""
    assert gguf_model.tokenizer.vocab_size == len(reference_tokenizer)
    assert gguf_model.tokenizer.bos_id == reference_tokenizer.bos_token_id == BOS_ID
    assert reference_tokenizer.bos_token == SPECIAL_TOKENS[BOS_ID]
