"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), read into the chat request
kvlm already serves.

Honoured: system (a string or text blocks), messages of text / tool_use / tool_result / thinking blocks (a
user message's tool results become tool messages before its text, as the results answer the calls before it),
tools with input_schema, tool_choice auto / any / tool / none with disable_parallel_tool_use, thinking enabled /
adaptive / between_tools / disabled (the template's `enable_thinking`, false without `thinking`, Anthropic's default;
budget_tokens is not enforced, as in llama.cpp's server; display "omitted" leaves the thinking out), output_config.format (a JSON schema) and
output_config.effort (low / medium / high, to the template as chat's reasoning_effort), stop_sequences, max_tokens,
and temperature, top_p, top_k (which today's SDK sends through extra_body). Accepted and changing nothing: metadata,
service_tier, speed, inference_geo, user_profile_id, workspace_id, cache_control (kvlm caches every prefix by
itself), a thinking block's signature, redacted_thinking blocks (their text is encrypted; they are dropped).

Refused by name (400): image, document and search-result blocks, server tools (web search, code execution:
any tool with a `type` other than "custom"), `container`, `mcp_servers`, output_config.effort xhigh or max, and a
last message from the assistant (a prefilled reply to continue).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kvlm.server.protocol import REASONING_EFFORTS, BadRequest, ChatCompletionRequest, validated

# the chat request's field names as a Messages client knows them, for an error's `param`
MESSAGES_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "chat_template_kwargs": "thinking",
                   "response_format": "output_config.format", "reasoning_effort": "output_config.effort"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING_TYPES = ("enabled", "adaptive", "between_tools", "disabled")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    format: dict[str, Any] | None = None

    def chat_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.effort is not None:
            if self.effort not in REASONING_EFFORTS:
                raise BadRequest(f"output_config.effort must be one of {', '.join(REASONING_EFFORTS)} here, got "
                                 f"{self.effort!r}", "output_config.effort")
            fields["reasoning_effort"] = self.effort
        if self.format is not None:
            if self.format.get("type") != "json_schema" or not isinstance(self.format.get("schema"), dict):
                raise BadRequest("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                                 "output_config.format")
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": self.format["schema"]}}
        return fields


class CountTokensRequest(BaseModel):
    """What a prompt is made of: the fields count_tokens takes, and the base of a whole request."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # accepted; they change nothing here
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # refused when set
    container: Any = None
    mcp_servers: Any = None

    def chat_fields(self) -> dict[str, Any]:
        for name in ("container", "mcp_servers"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported by this server", name)
        if self.messages[-1].get("role") == "assistant":
            last = f"messages[{len(self.messages) - 1}]"
            raise BadRequest(f"{last} is the assistant's: continuing a prefilled reply is not supported by this "
                             "server; end with a user message", f"{last}.role")
        system = [{"role": "system", "content": system_text(self.system)}] if self.system else []
        fields: dict[str, Any] = {"messages": system + chat_messages(self.messages), "tools": self.chat_tools()}
        fields |= self.chat_tool_choice() | (self.output_config.chat_fields() if self.output_config else {})
        if self.thinking is None:  # Anthropic's default: no thinking (for a template that lets it be turned off)
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        else:
            kind = self.thinking.get("type")
            if kind not in THINKING_TYPES:
                raise BadRequest(f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got {kind!r}",
                                 "thinking.type")
            fields["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
            fields["include_reasoning"] = self.thinking.get("display") != "omitted"
        return {k: v for k, v in fields.items() if v is not None}

    def chat_request(self) -> ChatCompletionRequest:
        return validated(ChatCompletionRequest, self.chat_fields(), MESSAGES_PARAMS)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type", "custom") != "custom":
                raise BadRequest(f"tools[{i}] is a server tool of type {tool['type']!r}; this server runs client "
                                 "tools only (name, description, input_schema)", f"tools[{i}].type")
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
                raise BadRequest(f"tools[{i}] needs a name and an input_schema object", f"tools[{i}]")
            spec = {"name": tool["name"], "parameters": tool["input_schema"]}
            if tool.get("description"):
                spec["description"] = tool["description"]
            tools.append({"type": "function", "function": spec})
        return tools or None

    def chat_tool_choice(self) -> dict[str, Any]:
        """tool_choice and parallel_tool_calls as chat takes them (none where the request gives no choice)."""
        choice = self.tool_choice
        if choice is None:
            return {}
        kind = choice.get("type")
        fields: dict[str, Any] = {"parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)}
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise BadRequest("tool_choice of type tool needs the tool's name", "tool_choice.name")
            return fields | {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
        if kind not in TOOL_CHOICES:
            raise BadRequest(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")
        return fields | {"tool_choice": TOOL_CHOICES[kind]}


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        fields = self.chat_fields() | {"max_completion_tokens": self.max_tokens, "stop": self.stop_sequences,
                                       "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return validated(ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None}, MESSAGES_PARAMS)


def system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(text_of(block, f"system[{j}]") for j, block in enumerate(system))


def text_of(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise BadRequest(f"{param} has type {kind!r}: this server reads text blocks only here (no image, "
                         "document or search-result input)", f"{param}.type")
    return block["text"]


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}].role must be user or assistant, got {role!r}", f"messages[{i}].role")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of content blocks",
                             f"messages[{i}].content")
        out += assistant_message(blocks, i) if role == "assistant" else user_messages(blocks, i)
    return out


def user_messages(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """Tool results as tool messages, then the text as a user message."""
    tools, texts = [], []
    for j, block in enumerate(blocks):
        param = f"messages[{i}].content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            content = block.get("content", "")
            if not isinstance(content, str):
                content = "\n".join(text_of(part, f"{param}.content[{k}]") for k, part in enumerate(content or []))
            if block.get("is_error"):
                content = f"Error: {content}"
            tools.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content})
        else:
            texts.append(text_of(block, param))
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def assistant_message(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise BadRequest(f"messages[{i}].content[{j}].thinking must be a string",
                                 f"messages[{i}].content[{j}].thinking")
            reasoning.append(block["thinking"])
        elif kind != "redacted_thinking":
            texts.append(text_of(block, f"messages[{i}].content[{j}]"))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return [message]
