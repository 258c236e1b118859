"""OpenAI's harmony format (gpt-oss): the output is a series of messages, and what each one is (reasoning, answer,
tool call) comes from its header's channel and recipient, not from markers around a part of the text.

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}

A header runs to `<|message|>`: the first message's role is the prompt's `<|start|>assistant`, later ones start
with `<|start|>assistant`. A body runs to `<|end|>`, `<|call|>` or `<|return|>`, or to the end of the output, since
the last two are the turn's stop tokens, whose text is never emitted. Headers are read as openai-harmony reads them:
`<|channel|>NAME`, a recipient `to=NAME` before or after the channel, and last an optional content type (`json` or
`<|constrain|>json`).

What the messages give follows vLLM's reading of a chat output (its harmony `parse_chat_output` and `openai` tool
parser): the analysis channel is reasoning; the final channel, and commentary to no one (a preamble meant for the
user), are content; a message to `functions.NAME` is a call to NAME with the body as its JSON arguments. Several
messages of one kind are joined by a newline. A call body that cannot be JSON arguments is content, as kvlm's other
formats keep a block that is not a call. The rest (a message to a built-in tool on the commentary channel, another
role's message, text between messages) is left out, as llama.cpp's parser skips it. An output with no harmony
header at all, from a model that did not write harmony, is content as it is.

While streaming, a header counts only once whole and body text that may be the start of an end marker is held
back, so the reading of the output so far only grows: the stream's deltas join to the finished reading.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kvlm.tool_calls.calls import Malformed, PartialCall, PartialOutput
from kvlm.tool_calls.format import ToolCallFormat, Tools, held_back
from kvlm.tool_calls.grammar import alternatives, functions, json_rule, literal, marker
from kvlm.tool_calls.partial_json import read_value, skip_whitespace

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN)
ROLE = "assistant"
FUNCTIONS = "functions."
_CHANNEL_NAME = re.compile(r"[^\s<]*")  # openai-harmony: a channel's name ends at whitespace or a marker
REASONING, CONTENT = "analysis", "content"


def is_harmony_template(chat_template: str | None) -> bool:
    """A chat template that writes harmony messages (gpt-oss's)."""
    return CHANNEL in (chat_template or "") and MESSAGE in (chat_template or "")


@dataclass(frozen=True)
class Header:
    channel: str | None
    recipient: str | None
    content_type: str | None


def read_header(text: str) -> Header | None:
    """The header of an assistant's message; None for another role's or one that does not read as a header.

    As openai-harmony's parser: the channel is cut out, a space put before `<|constrain|>`, and of the words left
    (the role first, when the header writes it) the last is the recipient if it says `to=` or stands alone, else the
    content type, with the recipient before it."""
    start = text.rfind(START)  # text before a message's start is not part of any message
    role_written = start >= 0
    text = text[start + len(START):] if role_written else text
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        after = text[at + len(CHANNEL):]
        channel = _CHANNEL_NAME.match(after).group()
        if not channel:
            return None
        text = text[:at] + " " + after[len(channel):]
    words = text.replace(CONSTRAIN, " " + CONSTRAIN).split()
    if role_written and words[:1] != [ROLE]:
        return None
    if words[:1] == [ROLE]:
        words = words[1:]
    recipient = content_type = None
    if words:
        last = words.pop()
        if last.startswith("to=") or not words:
            recipient = last.removeprefix("to=")
        else:
            content_type = last
            recipient = words.pop().removeprefix("to=")
    return None if words else Header(channel, recipient, content_type)


@dataclass(frozen=True)
class Message:
    header: Header | None  # None: not an assistant's header
    body: str
    body_start: int  # where the body starts in the output
    closed: bool  # an end marker followed the body

    @property
    def function(self) -> str | None:
        """The function the message calls, if it is to `functions.NAME`."""
        recipient = self.header.recipient if self.header else None
        if recipient and recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
            return recipient[len(FUNCTIONS):]
        return None

    @property
    def kind(self) -> str | None:
        """REASONING, CONTENT, or None for a message left out (calls are found by `function` first)."""
        if self.header is None:
            return None
        if self.header.channel == "analysis":
            return REASONING
        if self.header.channel == "final" or (self.header.channel == "commentary" and not self.header.recipient):
            return CONTENT
        return None


def read_messages(text: str, final: bool) -> list[Message]:
    """The messages whose header is whole; a last body without its end marker is held back, while streaming, by
    whatever may be the start of one."""
    messages, pos = [], 0
    while (opened := text.find(MESSAGE, pos)) >= 0:
        header, body_start = read_header(text[pos:opened]), opened + len(MESSAGE)
        ends = [(found, end) for end in BODY_ENDS if (found := text.find(end, body_start)) >= 0]
        if not ends:
            body = text[body_start:]
            if not final:
                body = body[:len(body) - max(held_back(body, end) for end in BODY_ENDS)]
            messages.append(Message(header, body, body_start, closed=False))
            break
        found, end = min(ends)
        messages.append(Message(header, text[body_start:found], body_start, closed=True))
        pos = found + len(end)
    return messages


def read_arguments(body: str, tools: Tools = ()) -> tuple[list[PartialCall], bool]:
    """A call message's body, its arguments: the certain prefix of their JSON (a call with no name; the header names
    it) and whether it is whole. Malformed when it is not, and cannot become, one JSON object."""
    node, end = read_value(body, 0)
    if node.text and not node.text.startswith("{"):
        raise Malformed("a call's arguments are not a JSON object")
    if node.done and skip_whitespace(body, end) < len(body):
        raise Malformed("text after a call's arguments")
    return [PartialCall(None, node.text)], node.done


def _call(message: Message, final: bool) -> PartialCall | None:
    """The message's call, its arguments so far; None when its body cannot be (or, finished, is not) arguments."""
    try:
        [call], whole = read_arguments(message.body)
    except Malformed:
        return None
    if (message.closed or final) and not whole:
        # a message that ended with nothing written calls the function without arguments; one cut short is no call
        return None if message.body.strip() else PartialCall(message.function, "{}")
    return PartialCall(message.function, call.arguments)


@dataclass(frozen=True)
class HarmonyOutput:
    reasoning: str
    content: str
    calls: list[PartialCall]


def _joined(parts: list[str]) -> str:
    return "\n".join(part for part in parts if part)  # (an empty part adds no separator, so the join only grows)


def read_output(text: str, final: bool = False) -> HarmonyOutput:
    """The reasoning, content and calls of the output so far (certain prefixes; all of them when `final`)."""
    messages = read_messages(text, final)
    if not messages and CHANNEL not in text and MESSAGE not in text:
        return HarmonyOutput("", text if final else "", [])  # not harmony (yet): all content, once finished
    parts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
    calls = []
    for message in messages:
        kind = message.kind
        if message.function is not None:
            call = _call(message, final)
            if call is not None:
                calls.append(call)
                continue
            kind = CONTENT  # a body that is not arguments stays visible
        if kind is not None:
            parts[kind].append(message.body)
    return HarmonyOutput(_joined(parts[REASONING]), _joined(parts[CONTENT]), calls)


def answer_start(text: str) -> int | None:
    """Where the body of the first final-channel message starts (what a response format constrains); None before
    one has begun."""
    return next((m.body_start for m in read_messages(text, final=False)
                 if m.header is not None and m.header.channel == "final" and m.function is None), None)


def grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool,
            special_tokens: Collection[str] | None) -> str:
    """Any analysis messages, then one call message in the header OpenAI's docs show gpt-oss writing, ended by
    `<|call|>`. A call ends the turn (`<|call|>` is a stop token), so a turn holds one call, parallel or not.

    The analysis text is free up to `<|end|>`: followed by the special token it is a plain pattern (no text matches
    a special token); spelled as text, the marker must end the pattern as its suffix."""
    def token(text: str) -> str:
        return marker(text, special_tokens)

    free_text = "/(.|\\n)*/"
    if token(END) == END:
        analysis_text, text_rules = f"{free_text} {END}", []
    else:
        analysis_text, text_rules = "analysis_text", [f"analysis_text[suffix={literal(END)}]: {free_text}"]
    names = [f"function_{i}" for i in range(len(functions))]
    rules = [f"start: (analysis {token(START)} {literal(ROLE)})* ({alternatives(names)})",
             f"analysis: {token(CHANNEL)} {literal('analysis')} {token(MESSAGE)} {analysis_text}", *text_rules]
    for rule, (name, parameters) in zip(names, functions):
        header = f"{token(CHANNEL)} {literal('commentary to=' + FUNCTIONS + name + ' ')} {token(CONSTRAIN)} "
        rules.append(f"{rule}: {header}{literal('json')} {token(MESSAGE)} {json_rule(parameters, an_object=True)} "
                     f"{token(CALL)}")
    return "\n".join(rules) + "\n"


def call_header_grammar(functions: list[tuple[str, dict[str, Any]]], special_tokens: Collection[str] | None) -> str:
    """A call message from its header's start (after `<|start|>`, or the output's start for the first message, whose
    role the prompt wrote): the recipient `to=functions.NAME` of an offered function after the commentary channel or
    before it (both are harmony's), an optional content type (`<|constrain|>json` or `json`), then arguments its
    schema allows and `<|call|>`."""
    def token(text: str) -> str:
        return marker(text, special_tokens)

    channel = f"{token(CHANNEL)} {literal('commentary')}"
    content_type = f"(({literal(' ')} {token(CONSTRAIN)}? | {token(CONSTRAIN)}) {literal('json')})?"
    after, before = [], []
    rules = []
    for i, (name, parameters) in enumerate(functions):
        recipient, body = literal("to=" + FUNCTIONS + name), f"{token(MESSAGE)} {json_rule(parameters, an_object=True)}"
        after.append(f"after_{i}")
        before.append(f"before_{i}")
        rules += [f"after_{i}: {recipient} {content_type} {body} {token(CALL)}",
                  f"before_{i}: {recipient} {channel} {content_type} {body} {token(CALL)}"]
    return "\n".join([f"start: {literal(ROLE)}? ({channel} {literal(' ')} ({alternatives(after)}) | "
                      f"{literal(' ')}? ({alternatives(before)}))", *rules]) + "\n"


def in_header(text: str, at: int) -> bool:
    """Whether `at` is inside a message's header: no `<|message|>` since the output's start or the header's."""
    last_body = text.rfind(MESSAGE, 0, at)
    return last_body < 0 or max(text.rfind(START, 0, at), text.rfind(CHANNEL, 0, at)) > last_body


@dataclass(frozen=True)
class HarmonyFormat(ToolCallFormat):
    """Calls as harmony messages; `read` reads one call message's body (its arguments)."""

    @property
    def markers(self) -> tuple[str, ...]:
        return START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL

    @property
    def lazy(self) -> bool:
        return True

    def lazy_start(self, text: str) -> int | None:
        """The start of the header that names a recipient `to=functions.` (never one in a message's text)."""
        at = text.find("to=" + FUNCTIONS)
        while at >= 0 and not in_header(text, at):
            at = text.find("to=" + FUNCTIONS, at + 1)
        if at < 0:
            return None
        start = text.rfind(START, 0, at)
        return 0 if start < 0 else start + len(START)

    def lazy_grammar(self, tools: Tools, parallel: bool = True, special_tokens: Collection[str] | None = None) -> str:
        return call_header_grammar(functions(tools), special_tokens)

    @property
    def reads_channels(self) -> bool:
        return True

    def parse_partial(self, text: str, tools: Tools = (), final: bool = False) -> PartialOutput:
        """`text` is the whole output: the content is that of the final and preamble messages."""
        output = read_output(text, final)
        return PartialOutput(output.content, output.calls)


FORMAT = HarmonyFormat("harmony", read_arguments, grammar)
