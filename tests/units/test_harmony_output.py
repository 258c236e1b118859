"""gpt-oss's output (OpenAI's harmony format) read into reasoning, content and tool calls, whole and streamed; the
grammar that forces a call; and the stop tokens of a harmony vocabulary.

The outputs are written as gpt-oss writes them: the examples of OpenAI's harmony guide (openai/harmony, docs/format.md:
"Example output", "Receiving tool calls", "Preambles"), and a call in the header form the gpt-oss chat template
writes for past calls (rendered here from tests/data/gpt-oss-chat-template.jinja). The engine never emits the text
of a stop token, so a finished output ends without its <|return|> or <|call|>. What they must give is vLLM's reading
(its harmony parse_chat_output and `openai` tool parser): analysis is reasoning, final and commentary to no one
(a preamble) content, a message to functions.NAME a call to NAME with the JSON body as arguments.
"""
from __future__ import annotations

import json
import re

import llguidance
import pytest
from helpers.gguf_factory import gguf_metadata, llama_config
from helpers.harmony_factory import TEMPLATE, harmony_metadata, harmony_tokenizer
from helpers.tool_calls import arguments, names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlm.text.tokenizer import StreamDecoder, Tokenizer
from kvlm.tool_calls.chat_output import ChatOutputSpec, ChoiceStream
from kvlm.tool_calls.formats import HARMONY, format_for_template
from kvlm.tool_calls.harmony import answer_start, read_header
from kvlm.tool_calls.reasoning import HarmonyReasoning, reasoning_for_template
from kvlm.tool_calls.streaming import ContentDelta, ToolCallStream
from kvlm.tool_calls.tool_choice import plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["location"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
WITH_TOOLS = ChatOutputSpec(HarmonyReasoning(), HARMONY, tuple(TOOLS))
WITHOUT_TOOLS = ChatOutputSpec(HarmonyReasoning())

# docs/format.md, "Example output" (less its stop token)
ANSWER_REASONING = 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
ANSWER = (f"<|channel|>analysis<|message|>{ANSWER_REASONING}<|end|>"
          "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")
# docs/format.md, "Receiving tool calls"
CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}')
# docs/format.md, "Preambles": no space before <|constrain|>
PREAMBLE = ('<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>commentary'
            '<|message|>**Action plan**:\n1. Generate an HTML file\n2. Generate a JavaScript for the Node.js server\n'
            '3. Start the server\n---\nWill start executing the plan step by step<|end|><|start|>assistant<|channel|>'
            'commentary to=functions.generate_file<|constrain|>json<|message|>{"template": "basic_html", "path": '
            '"index.html"}')


def template_written_call() -> str:
    """A past call as the gpt-oss template renders it (recipient in the role, `json` without <|constrain|>): the
    assistant's part after the generation prompt, less its <|call|>."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"location": "Zürich", "unit": "c"}}}
    rendered = harmony_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Weather in Zürich?"},
         {"role": "assistant", "content": None, "thinking": "I need the forecast.", "tool_calls": [call]}],
        add_generation_prompt=False, tools=TOOLS)
    return rendered.split("<|start|>assistant", 1)[1].removesuffix("<|call|>")


TEMPLATE_CALL = template_written_call()
# name: (output, reasoning, content, calls, finish_reason), the last for an output the model ended itself
OUTPUTS = {
    "final answer after analysis": (ANSWER, ANSWER_REASONING, "2 + 2 = 4.", [], "stop"),
    "a call with arguments": (CALL, "Need to use function get_weather.", None,
                              [("get_weather", '{"location": "San Francisco"}')], "tool_calls"),
    "a call as the template writes it": (TEMPLATE_CALL, "I need the forecast.", None,
                                         [("get_weather", '{"location": "Zürich", "unit": "c"}')], "tool_calls"),
    "a preamble, then a call": (PREAMBLE, "{long chain of thought}",
                                PREAMBLE.split("<|message|>")[2].split("<|end|>")[0],
                                [("generate_file", '{"template": "basic_html", "path": "index.html"}')], "tool_calls"),
    # with its stop token ignored (ignore_eos), the model takes another turn: its <|call|> is then in the text
    "two calls": (CALL + "<|call|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
                  '<|message|>{"zone":"Europe/Paris"}', "Need to use function get_weather.", None,
                  [("get_weather", '{"location": "San Francisco"}'), ("get_time", '{"zone": "Europe/Paris"}')],
                  "tool_calls"),
    "an answer ending in its written <|return|>": (ANSWER + "<|return|>", ANSWER_REASONING, "2 + 2 = 4.", [], "stop"),
    "two analysis messages": ("<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis"
                              "<|message|>Second.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
                              "First.\nSecond.", "Done.", [], "stop"),
    # docs/format.md, "Built-in tools": browser calls go to the analysis channel; vLLM reads them as reasoning
    "a built-in tool's call": ('<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query":"SF"}',
                               '{"query":"SF"}', None, [], "stop"),
    "a model that does not write harmony": ("Just text.", None, "Just text.", [], "stop"),
}
CUT = {  # cut off by max_tokens: (output, reasoning, content, calls)
    "reasoning only": ("<|channel|>analysis<|message|>User asks: \"What is", 'User asks: "What is', None, []),
    "inside the final header": ("<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>fin",
                                "Simple.", None, []),
    # as kvlm's other formats keep a block that is not a call, the cut arguments are content (vLLM drops them)
    "inside a call's arguments": (CALL.removesuffix('cisco"}'), "Need to use function get_weather.",
                                  '{"location":"San Fran', []),
}


def parsed(spec: ChatOutputSpec, text: str, reason: str) -> tuple:
    message, finish = spec.message(text, reason)
    calls = [(call["function"]["name"], call["function"]["arguments"]) for call in message.get("tool_calls", [])]
    return message.get("reasoning_content"), message["content"], calls, finish


def streamed(spec: ChatOutputSpec, pieces: list[str], reason: str) -> tuple:
    """The deltas of a stream fed `pieces`, assembled as a client does: every call's id and name once, first."""
    stream, reasoning, content, calls = ChoiceStream(spec), "", "", {}
    deltas = [delta for piece in pieces for delta in stream.deltas(piece)] + stream.last_deltas()
    for delta in deltas:
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls and call["function"]["name"]
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    return reasoning or None, content or None, [tuple(calls[i]) for i in sorted(calls)], stream.finish_reason(reason)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return harmony_tokenizer()


def tokens_of(tokenizer: Tokenizer, text: str) -> list[str]:
    """The text as the engine emits it for the model's tokens: token by token, special tokens kept."""
    decoder = StreamDecoder(tokenizer, skip_special_tokens=False)
    pieces = [decoder.feed(i) for i in tokenizer.encode(text, add_special_tokens=False)] + [decoder.flush()]
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("name", OUTPUTS)
def test_finished_outputs_read_as_vllm_reads_them(name):
    text, reasoning, content, calls, finish = OUTPUTS[name]
    assert parsed(WITH_TOOLS, text, "stop") == (reasoning, content, calls, finish)


@pytest.mark.parametrize("name", OUTPUTS)
def test_without_tools_calls_are_not_returned_and_the_answer_is_the_content(name):
    text, reasoning, content, calls, _ = OUTPUTS[name]
    assert parsed(WITHOUT_TOOLS, text, "stop") == (reasoning, content, [], "stop")


@pytest.mark.parametrize("name", CUT)
def test_outputs_cut_by_max_tokens(name):
    text, reasoning, content, calls = CUT[name]
    assert parsed(WITH_TOOLS, text, "length") == (reasoning, content, calls, "length")


@pytest.mark.parametrize("spec", [WITH_TOOLS, WITHOUT_TOOLS], ids=["tools", "no tools"])
@pytest.mark.parametrize("name", [*OUTPUTS, *CUT])
def test_streamed_token_by_token_equals_the_finished_parse(tokenizer, spec, name):
    text, reason = (OUTPUTS[name][0], "stop") if name in OUTPUTS else (CUT[name][0], "length")
    whole = parsed(spec, text, reason)
    if name == "inside a call's arguments" and spec is WITH_TOOLS:
        # the stream announced the call before it was cut; it keeps it, as every format's stream does
        assert streamed(spec, tokens_of(tokenizer, text), reason)[:2] == whole[:2]
        return
    assert streamed(spec, tokens_of(tokenizer, text), reason) == whole


def test_a_possible_marker_is_held_back():
    stream = ToolCallStream(HARMONY, TOOLS)
    head = "<|channel|>final<|message|>Hi <|"
    assert stream.update(head) == [ContentDelta("Hi ")]
    assert stream.update(head + "en") == []  # may still be <|end|>
    assert stream.update(head + "en|x") == [ContentDelta("<|en|x")]
    fresh = ToolCallStream(HARMONY, TOOLS)  # a header counts once whole
    assert fresh.update("<|channel|>final<|mess") == []
    assert fresh.update("<|channel|>final<|message|>A") == [ContentDelta("A")]


def test_a_call_is_announced_when_its_header_is_whole_and_its_arguments_stream():
    stream = ToolCallStream(HARMONY, TOOLS)
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert stream.update(header[:-4]) == []
    [head] = stream.update(header)
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "") and head.id.startswith("call_")
    [more] = stream.update(header + '{"location": "Pa')
    assert (more.id, more.arguments) == (None, '{"location": "Pa')
    assert [d.arguments for d in stream.finish(header + '{"location": "Paris"}')] == ['ris"}']


# --- any output, cut anywhere ----------------------------------------------------------------------------------

texts = st.lists(st.sampled_from(["Hi", " ", "\n", "<", "|", "<|", "end", "é🙂", "{", "}", "to=x", "json"]),
                 max_size=6).map("".join)

# gpt-oss writes its markers as special tokens; a marker's text inside a call's JSON string would be the same text,
# which no reader of the text (this one, or any) can tell from the token. Hypothesis draws strings from the code's
# constants, so it does find "<|return|>": arguments here hold none.
MARKER_TEXT = re.compile(r"<\|[a-z]+\|>")
call_arguments = arguments.filter(lambda args: not MARKER_TEXT.search(json.dumps(args, ensure_ascii=False)))


@st.composite
def harmony_outputs(draw):
    """Messages as gpt-oss writes them, and what vLLM's reading of them gives."""
    kinds = draw(st.lists(st.sampled_from(["analysis", "final", "preamble", "call", "builtin"]), min_size=1,
                          max_size=5))
    headers, bodies, reasoning, content, calls = [], [], [], [], []
    for kind in kinds:
        if kind == "call":
            name, args = draw(names), draw(call_arguments)
            compact, ascii_only = draw(st.booleans()), draw(st.booleans())
            recipient_first = draw(st.booleans())
            headers.append(f" to=functions.{name}<|channel|>commentary json" if recipient_first
                           else f"<|channel|>commentary to=functions.{name} <|constrain|>json")
            bodies.append(json.dumps(args, ensure_ascii=ascii_only, separators=(",", ":") if compact else None))
            calls.append((name, json.dumps(args, ensure_ascii=False)))
            continue
        text = draw(texts)
        channel = {"analysis": "analysis", "final": "final"}.get(kind, "commentary")
        headers.append(f"<|channel|>{channel}" + (" to=browser.search <|constrain|>json" if kind == "builtin" else ""))
        bodies.append(text)
        if text and kind in ("analysis", "final", "preamble"):
            (reasoning if kind == "analysis" else content).append(text)
    ends = ["<|call|>" if kind == "call" else "<|end|>" for kind in kinds]
    ends[-1] = draw(st.sampled_from(["", "<|return|>" if kinds[-1] != "call" else "<|call|>"]))
    output = "".join(("<|start|>assistant" if i else "") + header + "<|message|>" + body + end
                     for i, (header, body, end) in enumerate(zip(headers, bodies, ends)))
    joined_content = "\n".join(content)
    return output, ("\n".join(reasoning) or None, joined_content if joined_content.strip() else None, calls,
                    "tool_calls" if calls else "stop")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(output=harmony_outputs(), cuts=st.lists(st.integers(0, 10**6), max_size=30))
def test_any_output_reads_as_vllm_reads_it_whole_and_cut_anywhere(output, cuts):
    text, expected = output
    assert parsed(WITH_TOOLS, text, "stop") == expected
    points = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    assert streamed(WITH_TOOLS, [text[a:b] for a, b in zip(points, points[1:])], "stop") == expected


# --- headers and the choice of readers ---------------------------------------------------------------------------

@pytest.mark.parametrize("header, channel, recipient, content_type", [
    ("<|channel|>analysis", "analysis", None, None),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json", "commentary", "functions.get_weather",
     "<|constrain|>json"),
    ("<|start|>assistant to=functions.f<|channel|>commentary json", "commentary", "functions.f", "json"),
    ("<|start|>assistant<|channel|>final", "final", None, None),
    ("<|channel|>commentary to=functions.a.b<|constrain|>json", "commentary", "functions.a.b", "<|constrain|>json"),
])
def test_headers_read_as_openai_harmony_reads_them(header, channel, recipient, content_type):
    found = read_header(header)
    assert (found.channel, found.recipient, found.content_type) == (channel, recipient, content_type)


@pytest.mark.parametrize("header", ["<|start|>functions.get_weather to=assistant<|channel|>commentary",
                                    "<|start|>user", "<|channel|>", "<|channel|>final a b c"])
def test_headers_that_are_not_an_assistant_message(header):
    assert read_header(header) is None


def test_the_gpt_oss_template_picks_harmony():
    prompt = harmony_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|start|>assistant")
    assert format_for_template(TEMPLATE) is HARMONY
    assert reasoning_for_template(TEMPLATE, prompt) == HarmonyReasoning()
    assert WITH_TOOLS.keeps_special_tokens and not ChatOutputSpec().keeps_special_tokens


def test_a_response_format_starts_at_the_final_body_and_a_forced_call_at_the_first_token():
    assert answer_start(ANSWER) == ANSWER.index("2 + 2 = 4.")
    assert answer_start(ANSWER[:ANSWER.index("2 + 2 = 4.") - 3]) is None and answer_start(CALL) is None
    untooled = plan_tools(TEMPLATE, [], "none", True, set)
    assert untooled.constraint_start(HarmonyReasoning())(ANSWER) == answer_start(ANSWER)  # a response format's start
    auto = plan_tools(TEMPLATE, TOOLS, "auto", True, set)
    assert auto.format is HARMONY and auto.forcing_grammar is None and auto.lazy_grammar is not None
    # under auto, the tools' grammar waits for a header that names a function: from that header's start
    assert auto.constraint_start(HarmonyReasoning()).find(ANSWER) is None
    assert auto.constraint_start(HarmonyReasoning()).find(CALL) == CALL.index("<|start|>") + len("<|start|>")
    forced = plan_tools(TEMPLATE, TOOLS, "required", False, set)
    assert forced.forcing_grammar is not None and forced.constraint_start(HarmonyReasoning()) is None


# --- the forcing grammar ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=tokenizer.vocab_size,
                                  eos_token=sorted(tokenizer.stop_ids))


def accepts(ll_tokenizer, tokenizer, lark: str, text: str) -> bool:
    """Whether the grammar takes the text's tokens and is complete after them."""
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


ANALYSIS = "<|channel|>analysis<|message|>Need the weather <in> Paris |x|.\n<|end|><|start|>assistant"
FORCED = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>'


def test_the_grammar_forces_one_call_after_any_analysis(tokenizer, ll_tokenizer):
    special = set(HARMONY.markers)
    lark = HARMONY.forcing_grammar(TOOLS, special_tokens=special)
    for text in (FORCED, ANALYSIS + FORCED, ANALYSIS + ANALYSIS + FORCED):
        assert accepts(ll_tokenizer, tokenizer, lark, text), text
        called = parsed(WITH_TOOLS, text.removesuffix("<|call|>"), "stop")[2]
        assert called == [("get_weather", '{"location": "Paris"}')]
    for text in (ANALYSIS + "<|channel|>final<|message|>Sunny.<|return|>",  # an answer instead
                 FORCED.replace("get_weather", "get_wether"),  # a function that is not a tool
                 FORCED.replace('"Paris"', "5"),  # arguments against the schema
                 FORCED.removesuffix("<|call|>"),  # not ended as a call
                 FORCED + "<|start|>assistant" + FORCED):  # a turn holds one call
        assert not accepts(ll_tokenizer, tokenizer, lark, text), text
    only_time = HARMONY.forcing_grammar(TOOLS, name="get_time", special_tokens=special)
    assert not accepts(ll_tokenizer, tokenizer, only_time, FORCED)
    assert accepts(ll_tokenizer, tokenizer, only_time, FORCED.replace("get_weather", "get_time").replace(
        '"location": "Paris"', '"zone": "UTC"'))


def test_the_grammar_takes_the_special_tokens_not_their_spelling(tokenizer, ll_tokenizer):
    lark = HARMONY.forcing_grammar(TOOLS, special_tokens=set(HARMONY.markers))
    spelled = ll_tokenizer.greedy_tokenize(ANALYSIS + FORCED)
    assert ll_tokenizer.decode_str(spelled) == ANALYSIS + FORCED
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not (matcher.consume_tokens(spelled) and matcher.is_accepting())


def test_the_grammar_with_markers_spelled_as_text():
    """A vocabulary without harmony's special tokens: the markers are text, the analysis ends at the spelled <|end|>."""
    plain = Tokenizer.from_gguf_metadata(gguf_metadata(llama_config()))
    ll_plain = llguidance.LLTokenizer(plain.backend_json(), n_vocab=plain.vocab_size, eos_token=sorted(plain.stop_ids))
    lark = HARMONY.forcing_grammar(TOOLS, special_tokens=())
    assert accepts(ll_plain, plain, lark, ANALYSIS + FORCED)
    assert not accepts(ll_plain, plain, lark, ANALYSIS + "<|channel|>final<|message|>Sunny.")


# --- the vocabulary's stop tokens --------------------------------------------------------------------------------

def test_a_harmony_vocabulary_stops_at_return_and_call_not_at_end(tokenizer):
    """As llama.cpp: <|return|> and <|call|> end the turn; <|end|> only ends a message (the analysis before the
    answer), so it is no stop token when both of those are."""
    ids = {text: tokenizer.encode(text, add_special_tokens=False)[0] for text in ("<|return|>", "<|call|>", "<|end|>")}
    assert ids["<|return|>"] in tokenizer.stop_ids and ids["<|call|>"] in tokenizer.stop_ids
    assert ids["<|end|>"] not in tokenizer.stop_ids
    without_call = harmony_metadata()
    without_call["tokenizer.ggml.tokens"] = [t if t != "<|call|>" else "<|cal|>" for t in
                                             without_call["tokenizer.ggml.tokens"]]
    assert ids["<|end|>"] in Tokenizer.from_gguf_metadata(without_call).stop_ids  # not a harmony vocabulary
