"""Gemma 4's tool calls and thought channel (kvlm.tool_calls.gemma4, reasoning.Gemma4Reasoning).

Independent references: Gemma 4's own chat template (tests/data/gemma4-chat-template.jinja, see test_gemma4_chat.py)
writes past calls in the model's notation, rendered as transformers renders it; kvlm must read back the arguments
it was given. The values vLLM's gemma4 parsers give for notation the template does not write are written out per
case from their code (vllm/tool_parsers/gemma4_tool_parser.py at vllm-project/vllm
027004de3715411197be51ced325705abcf740a7; vllm/reasoning/gemma4_reasoning_parser.py at
109eefd646368f8aa282b251a815c04fd5922975). The forcing grammar is run by llguidance over a vocabulary with Gemma 4's
chat tokens.
"""
from __future__ import annotations

import json
import keyword
import math

import llguidance
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlm.tool_calls.formats import GEMMA4, format_for_template
from kvlm.tool_calls.reasoning import Gemma4Reasoning, ReasoningStream, reasoning_for_template
from kvlm.loader.load import load_model
from kvlm.text.tokenizer import Tokenizer
from helpers.chat import MODEL, reference, write
from helpers.gemma4_chat import BYTE_LEVEL_SIZE, TEMPLATE, gemma4_chat_metadata
from helpers.gguf_factory import gguf_metadata, gguf_tensors, llama_config, random_llama, write_gguf
from helpers.tool_calls import SETTINGS, check_stream

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["c", "f"]},
                                     "hourly": {"type": "boolean"}, "ratio": {"type": "number"}},
    "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOOP]


@pytest.fixture(scope="module")
def hf_tokenizer(reference_tokenizer):
    return reference_tokenizer


def template_calls(hf_tokenizer, calls: list[tuple[str, dict]]) -> str:
    """The calls as the template writes them in an assistant turn (transformers' rendering), markers included."""
    message = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                                                   for n, a in calls]}
    text = reference(hf_tokenizer, TEMPLATE, [{"role": "user", "content": "Hi"}, message], False)
    return text[text.index(START):text.rindex(END) + len(END)]


def calls_of(parsed):
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


ARGUMENTS = [
    {"city": "São Paulo, {BR}: \"centre\"\nline two", "days": 3, "hourly": True, "ratio": 0.25},
    {"nested": {"a": [1, 2.5, "x", None, False], "b": {}}, "empty": [], "none": None},
    {"items": [{"name": "a", "qty": 2}, {"name": "b", "qty": -7}], "tags": ["x y", "z:w"]},
    {},
]


def test_format_for_the_template():
    assert format_for_template(TEMPLATE) is GEMMA4
    assert isinstance(reasoning_for_template(TEMPLATE, "<|turn>model\n"), Gemma4Reasoning)
    # the generation prompt with thinking off closes an empty thought channel: no reasoning parser
    assert reasoning_for_template(TEMPLATE, "<|turn>model\n<|channel>thought\n<channel|>") is None


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_calls_the_template_writes_read_back_as_given(hf_tokenizer, arguments):
    text = template_calls(hf_tokenizer, [("get_weather", arguments), ("noop", {"k": 1})])
    parsed = GEMMA4.parse("Let me look.\n" + text, TOOLS)
    assert parsed.content == "Let me look.\n"
    assert calls_of(parsed) == [("get_weather", arguments), ("noop", {"k": 1})]
    assert parsed.calls[0].arguments == json.dumps(dict(sorted(arguments.items())), ensure_ascii=False)


names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda name: not keyword.iskeyword(name))
scalars = (st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=10).filter(lambda t: QUOTE not in t)
           | st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6)
           .filter(lambda f: "e" not in repr(f) and not math.isclose(f, 0) or f == 0.5))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
                      max_leaves=8)


@SETTINGS
@given(arguments=st.dictionaries(names, values, max_size=4), cuts=st.lists(st.integers(0, 10**6), max_size=8))
def test_template_calls_read_back_whole_and_streamed(hf_tokenizer, arguments, cuts):
    """Any arguments the template writes (strings without a quote token, numbers it writes with a "." or none) read
    back as given, and the stream of the output cut anywhere assembles to that parse."""
    text = "Sure.\n" + template_calls(hf_tokenizer, [("noop", arguments)])
    assert calls_of(GEMMA4.parse(text, TOOLS)) == [("noop", arguments)]
    check_stream(GEMMA4, text, cuts, TOOLS)


@pytest.mark.parametrize("body, expected", [
    # vLLM's _parse_gemma4_value: true/false as written, null/none/nil in any case, "." makes a float, int() an int,
    # anything else the text; _normalize_gemma4_key: a quoted key is its text
    ('a:true,b:false,c:True', {"a": True, "b": False, "c": "True"}),
    ('a:null,b:None,c:NIL', {"a": None, "b": None, "c": None}),
    ('a:3.,b:-0.5,c:007,d:1e5', {"a": 3.0, "b": -0.5, "c": 7, "d": "1e5"}),
    ('a: word ,b:<|"|> spaced <|"|>', {"a": "word", "b": " spaced "}),
    ('<|"|>quoted key<|"|>:1', {"quoted key": 1}),
    ('a:[ 1 , <|"|>x<|"|> ,[2]],b:{c:{d:[]}}', {"a": [1, "x", [2]], "b": {"c": {"d": []}}}),
])
def test_notation_reads_as_vllm_reads_it(body, expected):
    assert calls_of(GEMMA4.parse(f"{START}call:f{{{body}}}{END}")) == [("f", expected)]


@pytest.mark.parametrize("text", [
    f'{START}call:f{{a:<|"|>unterminated}}{END}',  # a string never closed
    f"{START}f{{a:1}}{END}",  # no call:
    f"{START}call:f{{a:1}} and more{END}",  # text after the arguments
    f"{START}call:{{a:1}}{END}",  # no name
    f"{START}call:f{{a:1,a:2}}{END}",  # a key twice
    f"{START}call:f{{a:1{END}",  # the arguments never closed
])
def test_what_is_no_call_stays_content(text):
    parsed = GEMMA4.parse("before " + text)
    assert parsed.calls == [] and parsed.content == "before " + text


def test_a_call_cut_off_before_its_end_marker_is_a_call_when_whole():
    assert calls_of(GEMMA4.parse(f"{START}call:f{{a:1}}")) == [("f", {"a": 1})]
    assert GEMMA4.parse(f"{START}call:f{{a:1").calls == []


# --- the thought channel ---

@pytest.mark.parametrize("text, expected", [
    ("<|channel>thought\nLet me think.<channel|>The answer.", ("Let me think.", "The answer.")),
    ("<|channel>thought\nstill thinking", ("still thinking", None)),  # cut off: all reasoning
    ("<|channel>no label<channel|>x", ("no label", "x")),
    ("Plain answer.", (None, "Plain answer.")),
    # a call opened in the channel ends the reasoning (vLLM: is_reasoning_end at <|tool_call>)
    (f"<|channel>thought\nI need the weather.{START}call:f{{}}{END}", ("I need the weather.", f"{START}call:f{{}}{END}")),
])
def test_the_thought_channel_splits_as_vllm_splits_it(text, expected):
    assert Gemma4Reasoning().split(text) == expected


@given(cuts=st.lists(st.integers(0, 200), max_size=10))
def test_the_thought_channel_streamed_equals_split(cuts):
    text = f"<|channel>thought\nHmm, <|chan thought\n.<channel|>Done <|tool_call>maybe.{START}call:f{{a:1}}{END}"
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    stream = ReasoningStream(Gemma4Reasoning())
    reasoning = content = ""
    for end in points[1:-1]:
        r, c = stream.update(text[:end])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish(text)
    assert (reasoning + r, content + c) == tuple(part or "" for part in Gemma4Reasoning().split(text))


# --- forcing calls ---

@pytest.fixture(scope="module", params=["gemma4 tokens", "plain"])
def vocabulary(request):
    """kvlm's tokenizer and llguidance's over it, and the markers that are special tokens there (as the server asks
    llguidance, kvlm.structured.compiler.GrammarCompiler.special_tokens): Gemma 4's chat tokens, which llguidance
    takes as special tokens; or a byte-level vocabulary without them, where the markers are text."""
    metadata = gemma4_chat_metadata()
    if request.param == "plain":
        metadata = {**gguf_metadata(llama_config(vocab_size=BYTE_LEVEL_SIZE)), "tokenizer.chat_template": TEMPLATE}
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    ll = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=tokenizer.vocab_size,
                                eos_token=sorted(tokenizer.stop_ids))
    special = set()
    for text in GEMMA4.markers:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ll.is_special_token(ids[0]):
            special.add(text)
    assert special == (set(GEMMA4.markers) if request.param != "plain" else set())
    return tokenizer, ll, special


def accepts(vocabulary, lark, text) -> bool:
    tokenizer, ll, _ = vocabulary
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


VALID = [{"city": "Zürich"}, {"city": "a, b <x>", "days": 3, "unit": "f"},
         {"city": "x", "days": 2, "hourly": False, "ratio": 0.5, "unit": "c"}]
INVALID = [{"days": 3}, {"city": "x", "unit": "k"}, {"city": "x", "days": 2.5}, {"city": 5}]


def test_the_forcing_grammar_takes_the_templates_calls_and_no_others(hf_tokenizer, vocabulary):
    special = vocabulary[2]
    lark = GEMMA4.forcing_grammar(TOOLS, special_tokens=special)
    for arguments in VALID:
        text = template_calls(hf_tokenizer, [("get_weather", arguments)])
        assert accepts(vocabulary, lark, text), text
        assert calls_of(GEMMA4.parse(text, TOOLS)) == [("get_weather", arguments)]
    both = template_calls(hf_tokenizer, [("get_weather", VALID[0]), ("noop", {"anything": [1, "x"]})])
    assert accepts(vocabulary, lark, both)
    for arguments in INVALID:
        text = template_calls(hf_tokenizer, [("get_weather", arguments)])
        assert not accepts(vocabulary, lark, text), text
    assert not accepts(vocabulary, GEMMA4.forcing_grammar(TOOLS, parallel=False, special_tokens=special), both)
    assert not accepts(vocabulary, GEMMA4.forcing_grammar(TOOLS, name="noop", special_tokens=special), both)
    assert accepts(vocabulary, GEMMA4.forcing_grammar(TOOLS, name="noop", special_tokens=special),
                   template_calls(hf_tokenizer, [("noop", {})]))


# --- through the server, end to end (a tiny random Llama with Gemma 4's chat tokens and template, its output
# scripted as in test_qwen35_chat.py) ---

THOUGHT_AND_CALL = ('<|channel>thought\nNeed the weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,'
                    'days:3}<tool_call|><|tool_response>')


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    metadata = gemma4_chat_metadata()
    config = llama_config(vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    path = write_gguf(tmp_path_factory.mktemp("gemma4-template") / "tiny.gguf", metadata,
                      gguf_tensors(random_llama(config)))
    return load_model(str(path), "float32", progress=False)


def test_a_chat_completion_with_thinking_and_tools_whole_and_streamed(client, model, script, reference_tokenizer):
    """The thought channel as reasoning_content, the call in OpenAI's shape, generation stopped at
    <|tool_response>; the same streamed; the prompt transformers' rendering with thinking on."""
    write(script, model, THOUGHT_AND_CALL)
    ask = {"role": "user", "content": "Weather in Paris for 3 days?"}
    kwargs = dict(model=MODEL, messages=[ask], tools=TOOLS, temperature=0, max_tokens=100,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    expected = ("Need the weather.", None, [("get_weather", '{"city": "Paris", "days": 3}')], "tool_calls")
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert (choice.message.model_extra.get("reasoning_content"), choice.message.content, calls,
            choice.finish_reason) == expected
    assert model.tokenizer.decode(script["prompts"][-1]) == reference(reference_tokenizer, TEMPLATE, [ask], True,
                                                                      TOOLS, enable_thinking=True)
    reasoning, content, streamed, finish = "", "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:
                streamed[part.index] = [part.function.name, ""]
            streamed[part.index][1] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning or None, content or None, [tuple(streamed[i]) for i in sorted(streamed)], finish) == expected


def test_tool_choice_required_forces_a_call_in_gemmas_notation(client, model, script):
    """Thinking off (the prompt closes an empty thought channel): the forcing grammar takes the output from its
    first token; the scripted call in Gemma's notation passes it and reads as OpenAI's call."""
    write(script, model, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>c<|"|>}<tool_call|>'
                         '<|tool_response>')
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice="required",
        temperature=0, max_tokens=100).choices[0]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}')]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
