"""Tool-call formats: parsing finished outputs of every format, choosing the format from a chat template, and
the forcing grammars, compiled by llguidance for the real Qwen2.5 vocabulary (tokenizer only, no weights)."""
from __future__ import annotations

import json
import re

import llguidance
import pytest

from helpers.tool_calls import xml_call
from kvlm.loader.fetch import pull
from kvlm.loader.gguf_reader import read_gguf_metadata
from kvlm.text.tokenizer import Tokenizer
from kvlm.tool_calls.calls import new_call_id
from kvlm.tool_calls.formats import (
    FORMATS, HERMES, JSON_FALLBACK, LFM2, LLAMA3_JSON, PYTHONIC, QWEN3_XML, format_for_template,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop"}}  # no parameters schema: any object
TOOLS = [WEATHER, NOOP]


def calls_of(parsed):
    return [(call.name, call.arguments) for call in parsed.calls]


# --- hermes ---------------------------------------------------------------------------------------------------

def test_hermes_content_before_calls_and_parallel_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n'
            '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    parsed = HERMES.parse(text)
    assert parsed.content == "Let me look.\n"
    assert calls_of(parsed) == [("get_weather", '{"city": "Zürich", "days": 3}'), ("noop", "{}")]


def test_hermes_only_calls_have_no_content_and_arguments_are_reserialized_unescaped():
    text = ('\n<tool_call>\n{"name":"f","arguments":{"q":"caf\\u00e9 \\ud83d\\ude00","n":1.50,"x":[1,{"y":null}]}}'
            '\n</tool_call>\n')
    parsed = HERMES.parse(text)
    assert parsed.content is None
    assert calls_of(parsed) == [("f", '{"q": "café 😀", "n": 1.5, "x": [1, {"y": null}]}')]


def test_hermes_text_after_the_last_block_is_content():
    text = 'Hi\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\nDone.'
    assert HERMES.parse(text).content == "Hi\n\nDone."


def test_hermes_malformed_block_stays_content():
    bad = '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'
    good = '<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call>'
    parsed = HERMES.parse(bad + "\n" + good)
    assert parsed.content == bad + "\n"
    assert calls_of(parsed) == [("g", '{"b": 2}')]


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": "{\\"a\\": 1}"}',  # arguments as a string, not an object
    '{"name": 3, "arguments": {}}',
    '{"arguments": {}}',
    '{"name": "f", "arguments": {}, "id": "x"}',
    '{"name": "f", "arguments": {"a": 1, "a": 2}}',  # a duplicate key would rewrite streamed arguments
    '{"name": "f", "arguments": {"a": NaN}}',
    '{"name": "f", "arguments": {}} trailing',
])
def test_hermes_bodies_that_are_not_calls_stay_content(body):
    text = f"<tool_call>\n{body}\n</tool_call>"
    assert HERMES.parse(text).content == text and HERMES.parse(text).calls == []


def test_hermes_accepts_parameters_key_a_missing_arguments_and_a_missing_end_marker():
    text = '<tool_call>\n{"name": "f", "parameters": {"a": true}}\n</tool_call><tool_call>\n{"name": "g"}\n'
    assert calls_of(HERMES.parse(text)) == [("f", '{"a": true}'), ("g", "{}")]


def test_hermes_call_cut_short_is_content():
    text = 'Sure <tool_call>\n{"name": "f", "arguments": {"a": 1'
    parsed = HERMES.parse(text)
    assert parsed.content == text and parsed.calls == []


# --- qwen3_xml ----------------------------------------------------------------------------------------------------

TYPED = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "room": {"type": "string"}, "guests": {"type": "integer"}, "price": {"type": "number"},
    "late": {"type": "boolean"}, "extras": {"type": "array"}, "meta": {"type": "object"},
    "note": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}


def test_qwen3_xml_converts_values_to_the_declared_types():
    text = "I'll book it.\n" + xml_call("book", room="Suite 7", guests="2", price="99.5", late="true",
                                        extras='["wifi", "tea"]', meta='{"vip": true}', note="null", code="007")
    parsed = QWEN3_XML.parse(text, [TYPED])
    assert parsed.content == "I'll book it.\n"
    assert json.loads(parsed.calls[0].arguments) == {
        "room": "Suite 7", "guests": 2, "price": 99.5, "late": True, "extras": ["wifi", "tea"],
        "meta": {"vip": True}, "note": None, "code": "007"}
    assert parsed.calls[0].arguments.startswith('{"room": "Suite 7", "guests": 2, "price": 99.5, "late": true')


def test_qwen3_xml_values_not_of_the_declared_type_and_unknown_parameters_stay_text():
    text = xml_call("book", guests="two", price="[1]", extra="42") + "\n" + xml_call("unknown_tool", n="5")
    parsed = QWEN3_XML.parse(text, [TYPED])
    assert calls_of(parsed) == [("book", '{"guests": "two", "price": "[1]", "extra": "42"}'),
                                ("unknown_tool", '{"n": "5"}')]


@pytest.mark.parametrize("schema, text, value", [
    # vLLM's qwen3_coder rules (Qwen3CoderToolParser._convert_param_value), which read the Python literals
    # Qwen3.5's template writes past arguments with
    ({"type": "boolean"}, "True", True), ({"type": "boolean"}, "FALSE", False), ({"type": "boolean"}, "yes", "yes"),
    ({"type": "integer"}, "07", 7), ({"type": "integer"}, "-12", -12), ({"type": "integer"}, "3.0", "3.0"),
    ({"type": "number"}, "3.0", 3), ({"type": "number"}, "1e3", 1000), ({"type": "number"}, "21.5", 21.5),
    ({"type": "number"}, "-2", -2), ({"type": "number"}, "inf", "inf"), ({"type": "number"}, "NaN", "NaN"),
    # "null"/"None" is null for a parameter that may be null or is of no string type
    ({"type": "integer"}, "None", None), ({"type": "boolean"}, "null", None), ({"type": "object"}, "NULL", None),
    ({"type": ["string", "null"]}, "None", None), ({"type": ["string", "null"]}, "Oslo", "Oslo"),
    ({"type": ["string", "null"]}, '"Oslo"', "Oslo"), ({"type": "string"}, "None", "None"), ({}, "null", "null"),
    ({"type": ["string", "integer"]}, "None", "None"),
    # a union: the first type in vLLM's order that the text reads as
    ({"type": ["integer", "string"]}, "7", 7), ({"type": ["boolean", "string"]}, "True", True),
    ({"type": ["integer", "number"]}, "2.5", 2.5),
    ({"type": "array"}, '{"a": 1}', '{"a": 1}'), ({"type": "object"}, '{"a": 1}', {"a": 1}),
])
def test_qwen3_xml_reads_values_as_vllm(schema, text, value):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"x": schema}}}}
    [call] = QWEN3_XML.parse(xml_call("f", x=text), [tool]).calls
    got = json.loads(call.arguments)["x"]
    assert got == value and type(got) is type(value)


def test_qwen3_xml_multiline_text_value_keeps_inner_newlines():
    text = xml_call("write", body='line 1\n\n  "quoted"\nlast')
    assert calls_of(QWEN3_XML.parse(text)) == [("write", '{"body": "line 1\\n\\n  \\"quoted\\"\\nlast"}')]


def test_qwen3_xml_no_parameters_and_malformed_blocks():
    empty = "<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    broken = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"  # no </parameter>
    parsed = QWEN3_XML.parse(broken + "\n" + empty)
    assert calls_of(parsed) == [("noop", "{}")]
    assert parsed.content == broken + "\n"


# --- llama3_json ----------------------------------------------------------------------------------------------

def test_llama3_json_calls_with_python_tag_and_separators():
    text = ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noop", "arguments": {}}'
    parsed = LLAMA3_JSON.parse(text)
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", '{"city": "Paris"}'), ("noop", "{}")]


@pytest.mark.parametrize("text", [
    '{"answer": 42}',
    '{"name": "f", "parameters": {}} and that is the call.',
    'The call would be {"name": "f", "parameters": {}}',
    "Plain prose.",
])
def test_llama3_json_output_is_calls_only_when_all_of_it_is(text):
    parsed = LLAMA3_JSON.parse(text)
    assert parsed.content == text and parsed.calls == []


# --- pythonic and lfm2 --------------------------------------------------------------------------------------------

def test_pythonic_literals_become_json():
    text = '[get_weather(city="Zürich", days=-3, extra={"a": (1, 2.5), "b": None}, ok=True, j=false), noop()]'
    parsed = PYTHONIC.parse(text)
    assert parsed.content is None
    assert calls_of(parsed) == [
        ("get_weather", '{"city": "Zürich", "days": -3, "extra": {"a": [1, 2.5], "b": null}, "ok": true, "j": false}'),
        ("noop", "{}")]


@pytest.mark.parametrize("text", [
    '[f(1)]',  # positional
    '[f(a=__import__("os").getcwd())]',  # never evaluated
    '[f(a=b)]',
    '[f(a=1, a=2)]',
    '[docs](https://example.com)',
    '[f(a=1)] and more',
    "Sure, [f(a=1)]",
])
def test_pythonic_that_is_not_a_list_of_literal_calls_is_content(text):
    parsed = PYTHONIC.parse(text)
    assert parsed.content == text and parsed.calls == []


def test_lfm2_wraps_a_pythonic_list():
    text = 'Checking.<|tool_call_start|>[get_weather(city="Paris"), noop(x=[1])]<|tool_call_end|>'
    parsed = LFM2.parse(text)
    assert parsed.content == "Checking."
    assert calls_of(parsed) == [("get_weather", '{"city": "Paris"}'), ("noop", '{"x": [1]}')]


def test_json_fallback_object_or_array():
    assert calls_of(JSON_FALLBACK.parse('{"name": "f", "arguments": {"a": 1}}')) == [("f", '{"a": 1}')]
    text = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": "é"}}]'
    assert calls_of(JSON_FALLBACK.parse(text)) == [("f", "{}"), ("g", '{"b": "é"}')]
    assert JSON_FALLBACK.parse("[]").content == "[]"


# --- ids and templates ---------------------------------------------------------------------------------------

def test_call_ids_are_openai_style_and_distinct():
    ids = {new_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    parsed = HERMES.parse('<tool_call>\n{"name": "f"}\n</tool_call><tool_call>\n{"name": "f"}\n</tool_call>')
    assert parsed.calls[0].id != parsed.calls[1].id
    assert parsed.calls[0].to_openai() == {"id": parsed.calls[0].id, "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}


LLAMA31_SNIPPET = ('{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}'
                   '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name '
                   'and its value}.\' }}{{- "<|python_tag|>" + tool_call.name + ".call(" }}')
LLAMA32_SNIPPET = ('{%- elif message.role == "tool" or message.role == "ipython" %}'
                   '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}')
PYTHONIC_SNIPPET = ("you MUST put it in the format of [func_name1(params_name1=params_value1, "
                    "params_name2=params_value2...), func_name2(params)]")
QWEN3_CODER_SNIPPET = ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                       "{{- '<parameter=' + args_name + '>\\n' }}")
LFM2_SNIPPET = '{%- set ns.system_prompt = ns.system_prompt + "List of tools: <|tool_list_start|>[" -%}'


def test_format_for_template(qwen_tokenizer):
    assert format_for_template(qwen_tokenizer.chat_template) is HERMES
    assert format_for_template(QWEN3_CODER_SNIPPET) is QWEN3_XML
    assert format_for_template(LLAMA31_SNIPPET) is LLAMA3_JSON
    assert format_for_template(LLAMA32_SNIPPET) is LLAMA3_JSON
    assert format_for_template(PYTHONIC_SNIPPET + LLAMA32_SNIPPET) is PYTHONIC
    assert format_for_template(LFM2_SNIPPET) is LFM2
    assert format_for_template("<|tool_call_start|>") is LFM2
    assert format_for_template("{{ messages[0].content }}") is None
    assert format_for_template(None) is None


# --- forcing grammars ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_tokenizer():
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(pull("qwen2.5-coder-0.5b-instruct", progress=False)))


@pytest.fixture(scope="module")
def ll_tokenizer(qwen_tokenizer):
    return llguidance.LLTokenizer(qwen_tokenizer.backend_json(), n_vocab=151936,
                                  eos_token=sorted(qwen_tokenizer.stop_ids))


def matcher(ll_tokenizer, lark):
    found = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not found.is_error(), found.get_error()
    return found


def accepts(ll_tokenizer, lark, ids):
    """Whether the grammar takes these token ids and may end after them (the model's stop token)."""
    found = matcher(ll_tokenizer, lark)
    return found.consume_tokens(ids) and not found.is_error() and found.is_accepting()


def qwen_ids(qwen_tokenizer, text):
    return qwen_tokenizer.encode(text, add_special_tokens=False)


HERMES_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>\n'
              '<tool_call>\n{"name": "noop", "arguments": {"anything": [1, "x"]}}\n</tool_call>')
VALID = {
    "hermes": HERMES_TWO,
    "qwen3_xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
                  "<tool_call>\n<function=noop>\n<parameter=x>\nfree text\n</parameter>\n</function>\n</tool_call>"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
                    '{"name": "noop", "parameters": {}}'),
    "pythonic": '[get_weather(city="Paris", days=2), noop(a=[1, 2])]',
    "json_fallback": '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "noop", "arguments": {}}]',
}
INVALID = {  # a wrong name, a schema violation, or the format's syntax broken
    "hermes": ['<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}\n</tool_call>',
               '{"name": "get_weather", "arguments": {"city": "Paris"}}',
               'Sure! <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'],
    "qwen3_xml": ["<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n<parameter=days>\nthree\n"
                  "</parameter>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n<parameter=unit>\nk\n"
                  "</parameter>\n</function>\n</tool_call>"],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": 5}}',
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}'],
    "pythonic": ['[get_weather(days=2)]', '[get_weather("Paris")]', 'get_weather(city="Paris")',
                 '[get_weather(city="Paris", unit="k")]'],
    "json_fallback": ['[{"name": "noop"}]', '[]', '[{"name": "get_weather", "arguments": {"city": null}}]'],
}
EXPECTED = {  # what the valid outputs parse to
    "hermes": [("get_weather", '{"city": "Zürich", "days": 3}'), ("noop", '{"anything": [1, "x"]}')],
    "qwen3_xml": [("get_weather", '{"city": "São Paulo", "days": 3}'), ("noop", '{"x": "free text"}')],
    "llama3_json": [("get_weather", '{"city": "Paris", "unit": "c"}'), ("noop", "{}")],
    "pythonic": [("get_weather", '{"city": "Paris", "days": 2}'), ("noop", '{"a": [1, 2]}')],
    "json_fallback": [("get_weather", '{"city": "Paris"}'), ("noop", "{}")],
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_forcing_grammar_accepts_calls_in_the_format_and_the_parser_reads_them(name, qwen_tokenizer, ll_tokenizer):
    fmt = FORMATS[name]
    lark = fmt.forcing_grammar(TOOLS, parallel=True)
    assert accepts(ll_tokenizer, lark, qwen_ids(qwen_tokenizer, VALID[name]))
    assert calls_of(fmt.parse(VALID[name], TOOLS)) == EXPECTED[name]
    for text in INVALID[name]:
        assert not accepts(ll_tokenizer, lark, qwen_ids(qwen_tokenizer, text)), text


@pytest.mark.parametrize("name", sorted(VALID))
def test_forcing_grammar_single_call_and_named_function(name, qwen_tokenizer, ll_tokenizer):
    fmt = FORMATS[name]
    both = qwen_ids(qwen_tokenizer, VALID[name])
    assert not accepts(ll_tokenizer, fmt.forcing_grammar(TOOLS, parallel=False), both)
    only_noop = fmt.forcing_grammar(TOOLS, name="noop", parallel=True)
    assert not accepts(ll_tokenizer, only_noop, both)  # the get_weather call is not allowed
    with pytest.raises(ValueError, match="nope"):
        fmt.forcing_grammar(TOOLS, name="nope")


def test_hermes_grammar_takes_the_special_tokens_not_the_text(qwen_tokenizer, ll_tokenizer):
    call = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    special = qwen_ids(qwen_tokenizer, call)
    assert special[0] == 151657 and special[-1] == 151658  # <tool_call>, </tool_call>: one token each
    lark = HERMES.forcing_grammar(TOOLS, parallel=False)
    assert accepts(ll_tokenizer, lark, special)
    spelled = ll_tokenizer.greedy_tokenize(call)  # the same text in ordinary tokens
    assert spelled != special and ll_tokenizer.decode_str(spelled) == call
    assert not accepts(ll_tokenizer, lark, spelled)
    as_text = HERMES.forcing_grammar(TOOLS, parallel=False, special_tokens=())
    assert accepts(ll_tokenizer, as_text, spelled) and not accepts(ll_tokenizer, as_text, special)


def test_hermes_grammar_accepts_what_the_qwen_template_writes_for_past_calls(qwen_tokenizer, ll_tokenizer):
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}},
             {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": {}}}]
    prompt = qwen_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}],
        add_generation_prompt=False, tools=TOOLS)
    written = prompt.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    assert accepts(ll_tokenizer, HERMES.forcing_grammar(TOOLS), qwen_ids(qwen_tokenizer, written))
    assert calls_of(HERMES.parse(written)) == [("get_weather", '{"city": "Zürich", "days": 3}'), ("noop", "{}")]


def test_lfm2_grammar_with_markers_as_text(qwen_tokenizer, ll_tokenizer):
    text = '<|tool_call_start|>[get_weather(city="Paris", unit="f"), noop()]<|tool_call_end|>'
    lark = LFM2.forcing_grammar(TOOLS, special_tokens=())
    assert accepts(ll_tokenizer, lark, qwen_ids(qwen_tokenizer, text))
    assert not accepts(ll_tokenizer, lark, qwen_ids(qwen_tokenizer, '[get_weather(city="Paris")]'))
    assert LFM2.forcing_grammar(TOOLS).startswith("start: <|tool_call_start|> ")  # special tokens by default
    assert calls_of(LFM2.parse(text)) == [("get_weather", '{"city": "Paris", "unit": "f"}'), ("noop", "{}")]


def test_grammar_arguments_follow_refs_and_bound_whitespace(qwen_tokenizer, ll_tokenizer):
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}}}
    lark = HERMES.forcing_grammar([tool])

    def call(arguments):
        return qwen_ids(qwen_tokenizer, f'<tool_call>\n{{"name": "move", "arguments": {arguments}}}\n</tool_call>')

    assert accepts(ll_tokenizer, lark, call('{"to": {"x": 1}}'))
    assert not accepts(ll_tokenizer, lark, call('{"to": {"x": "1"}}'))
    assert not accepts(ll_tokenizer, lark, call('{"to":' + " " * 20 + '{"x": 1}}'))


SECOND_REQUIRED = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "string"}}, "required": ["b"]}}}


@pytest.mark.parametrize("text, ok", [
    ("[f(b=True)]", True), ("[f(a=1, b=False)]", True), ("[f(b=True, c=\"x\")]", True),
    ("[f(a=1, b=True, c=\"x\")]", True),
    ("[f(a=1)]", False), ("[f(a=1, c=\"x\")]", False), ("[f(b=True, a=1)]", False), ("[f()]", False),
    ("[f(b=true)]", False),
])
def test_pythonic_grammar_keywords_in_schema_order_with_the_required_ones(text, ok, qwen_tokenizer, ll_tokenizer):
    lark = PYTHONIC.forcing_grammar([SECOND_REQUIRED], parallel=False)
    assert accepts(ll_tokenizer, lark, qwen_ids(qwen_tokenizer, text)) == ok


@pytest.mark.parametrize("params, ok", [({"b": "true"}, True), ({"a": "1", "b": "false", "c": "x"}, True),
                                        ({"a": "1"}, False), ({"b": "true", "a": "1"}, False)])
def test_qwen3_xml_grammar_parameters_in_schema_order_with_the_required_ones(params, ok, qwen_tokenizer,
                                                                              ll_tokenizer):
    lark = QWEN3_XML.forcing_grammar([SECOND_REQUIRED], parallel=False)
    assert accepts(ll_tokenizer, lark, qwen_ids(qwen_tokenizer, xml_call("f", **params))) == ok
