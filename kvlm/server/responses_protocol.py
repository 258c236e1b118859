"""OpenAI's Responses API request (`POST /v1/responses`), read into the chat request kvlm already serves.

Input is a string or a list of items: messages (roles user, system, developer, assistant; text parts), the model's
`function_call` items and the client's `function_call_output` items, and `reasoning` items sent back (their text
reaches the template as the next assistant message's reasoning_content). `instructions` is a system message before
them (not carried over to a response that continues this one, as OpenAI's). Function tools, tool_choice,
parallel_tool_calls, text.format (json_schema, json_object), reasoning.effort (to the chat template, as chat's
reasoning_effort), max_output_tokens, temperature, top_p and vLLM's top_k, seed and priority are honoured.

Refused by name (400): items other than those (images, files, built-in tool calls, item references), tools other
than functions, tool_choice of allowed_tools or a built-in tool, `background`, `conversation`, `prompt`,
`top_logprobs`, `truncation: "auto"` and `max_tool_calls`. Fields that change nothing here are accepted so that
SDKs work: metadata, user, safety_identifier, prompt_cache_key, service_tier, include, stream_options.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kvlm.server.protocol import REASONING_EFFORTS, BadRequest, ChatCompletionRequest, validated

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
# the chat request's field names as a Responses client knows them, for the `param` of an error
RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
                    "reasoning_effort": "reasoning.effort"}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise BadRequest("text.format of type json_schema needs a schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_}}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; templates take none


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    summary: str | None = None  # kvlm returns the reasoning text itself, never a summary
    generate_summary: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    priority: StrictInt = 0
    # accepted so that SDKs work; they change nothing here
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # refused when set (see check_supported)
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: StrictInt | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: StrictInt | None = None

    def check_supported(self) -> None:
        refused = {"background": self.background, "conversation": self.conversation, "prompt": self.prompt,
                   "top_logprobs": self.top_logprobs, "max_tool_calls": self.max_tool_calls,
                   "truncation": self.truncation if self.truncation == "auto" else None}
        for name, value in refused.items():
            if value:
                raise BadRequest(f"{name} is not supported by this server (got {value!r})", name)
        effort = self.reasoning.effort if self.reasoning else None
        if effort is not None and effort not in REASONING_EFFORTS:
            raise BadRequest(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                             "reasoning.effort")

    def function_tools(self) -> list[dict[str, Any]]:
        """The tools in chat's form; anything but a function tool is refused by name."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise BadRequest(f"tools[{i}] has type {tool.get('type')!r}: this server runs function tools only",
                                 f"tools[{i}].type")
            unknown = sorted(k for k, v in tool.items() if k not in FUNCTION_TOOL_KEYS and v is not None)
            if unknown:
                raise BadRequest(f"tools[{i}]: {', '.join(unknown)} not supported", f"tools[{i}].{unknown[0]}")
            spec = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            tools.append({"type": "function", "function": spec})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise BadRequest(f"tool_choice {choice!r} is not supported: give none, auto, required or "
                         "{\"type\": \"function\", \"name\": ...}", "tool_choice")

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response runs: instructions as a system message, then `messages` (a stored
        conversation this one continues, then the input, as input_messages reads it)."""
        self.check_supported()
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict[str, Any] = {
            "messages": system + messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "tools": self.function_tools() or None, "tool_choice": self.chat_tool_choice(),
            "reasoning_effort": self.reasoning.effort if self.reasoning else None, "priority": self.priority}
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        return validated(ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None}, RESPONSES_PARAMS)


def input_messages(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: an assistant's text, reasoning and function calls in a row make one message;
    each function_call_output a tool message."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant message they belong to

    def assistant() -> dict[str, Any]:
        if not (messages and messages[-1]["role"] == "assistant" and not reasoning):
            messages.append({"role": "assistant", "content": None})
        if reasoning:
            messages[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return messages[-1]

    for i, item in enumerate(input):
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            message = assistant()
            message["content"] = (message["content"] or "") + item_text(item.get("content"), f"input[{i}].content")
        elif kind == "message":
            if item.get("role") not in MESSAGE_ROLES:
                raise BadRequest(f"input[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got {item.get('role')!r}",
                                 f"input[{i}].role")
            messages.append({"role": item["role"], "content": item_text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": required(item, "call_id", i), "type": "function",
                    "function": {"name": required(item, "name", i), "arguments": item.get("arguments") or "{}"}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else item_text(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": required(item, "call_id", i), "content": content})
        elif kind == "reasoning":
            key = "content" if item.get("content") else "summary"
            parts = item.get(key) or []
            if not isinstance(parts, list):
                raise BadRequest(f"input[{i}].{key} must be a list of text parts", f"input[{i}].{key}")
            reasoning.append("".join(part_text(part, f"input[{i}].{key}[{j}]") for j, part in enumerate(parts)))
        else:
            raise BadRequest(f"input[{i}] is an item of type {kind!r}, which this server does not take (it takes "
                             "message, function_call, function_call_output and reasoning items)", f"input[{i}].type")
    return messages


def item_text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts joined; any other part is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise BadRequest(f"{param}[{j}] has type {kind!r}: this server reads text parts only (no image, audio "
                             "or file input)", f"{param}[{j}].type")
        texts.append(part_text(part, f"{param}[{j}]"))
    return "\n".join(texts)


def part_text(part: Any, param: str) -> str:
    """A part's `text`, which must be a string."""
    text = part.get("text") if isinstance(part, dict) else None
    if not isinstance(text, str):
        raise BadRequest(f"{param} must be an object whose text is a string, got {part!r}", f"{param}.text")
    return text


def required(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"input[{i}] ({item.get('type')}) needs {key}", f"input[{i}].{key}")
    return value
