"""OpenAI's request bodies as pydantic models, and their mapping onto `SamplingParams`.

Unknown fields are refused (400) rather than ignored, so a client never believes a setting took effect
when it did not. Besides OpenAI's fields, vLLM's extras are accepted: top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, structured_outputs (and its older guided_* spellings), and for chat
chat_template_kwargs and include_reasoning (OpenAI's reasoning_effort reaches the template as vLLM passes it, a
template variable); llama.cpp's json_schema and grammar on completions. OpenAI fields that
change nothing here are accepted so that SDKs work: `store`, `metadata`, `user`, and in messages sent back the
fields kvlm itself returns (`reasoning_content`, `refusal`, `annotations`, `audio`, `function_call`).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from kvlm.sampling.params import SamplingParams
from kvlm.structured.params import StructuredOutputsParams
from kvlm.text.tokenizer import checked_template_kwargs

MAX_N = 16  # choices per request
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 4, 256  # OpenAI takes up to 4 stop sequences
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs
REASONING_EFFORTS = ("low", "medium", "high")  # vLLM's (and the gpt-oss template's) values


class BadRequest(ValueError):
    """A request the server refuses with 400 (or `status`); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@contextmanager
def params_renamed(names: dict[str, str]) -> Iterator[None]:
    """A BadRequest raised inside names its field as another API knows it: the first part of its `param` renamed
    (the Responses and Messages APIs run as chat requests, whose checks name chat's fields)."""
    try:
        yield
    except BadRequest as exc:
        if exc.param is not None:
            head, dot, rest = exc.param.partition(".")
            exc.param = names.get(head, head) + dot + rest
        raise


Model = TypeVar("Model", bound=BaseModel)


def validated(model: type[Model], fields: dict[str, Any], names: dict[str, str]) -> Model:
    """`model` built from fields another API's request was translated into; a value it refuses is a 400 naming the
    field by `names` (see params_renamed)."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error["loc"])
        head, dot, rest = path.partition(".")
        param = names.get(head, head) + dot + rest
        raise BadRequest(f"{param}: {error['msg']} (got {error.get('input')!r})", param) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    store: StrictBool | None = None  # OpenAI's; nothing is stored here
    metadata: dict[str, str] | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: StrictInt = 0  # vLLM's: with --scheduling-policy priority, lower runs first

    def constraints(self) -> dict[str, StructuredOutputsParams]:
        """Each field that constrains the output, as the params it asks for (400 when one is malformed)."""
        found = {}
        if self.structured_outputs is not None:
            found["structured_outputs"] = _constraint("structured_outputs", self.structured_outputs)
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                found[field] = _constraint(field, {kind: getattr(self, field)})
        format_constraint = self.response_format.constraint() if self.response_format is not None else None
        if format_constraint is not None:
            found["response_format"] = format_constraint
        return found

    def constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint of this request; 400 when several fields give one."""
        found = self.constraints()
        if len(found) > 1:
            raise BadRequest(f"give at most one output constraint; got {', '.join(found)}", list(found)[1])
        return next(iter(found.values()), None)

    def _check_limits(self, logprobs: int | None) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise BadRequest(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                             f"characters, got {len(stops)} of up to {max(map(len, stops))}", "stop")
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise BadRequest(f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}", "logprobs")

    def n_choices(self) -> int:
        if not 1 <= self.n <= MAX_N:
            raise BadRequest(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        return self.n

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int,
                        structured_outputs: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool = True) -> SamplingParams:
        """The engine's params for choice `choice` of n: with a seed, choice i samples with seed + i.
        `skip_special_tokens` False keeps them in the output text, for a chat output read by special-token markers."""
        self._check_limits(logprobs)
        names = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "stop", "top_k",
                 "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
        values: dict[str, Any] = {name: getattr(self, name) for name in names}
        values.update(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured_outputs,
                      seed=None if self.seed is None else self.seed + choice, skip_special_tokens=skip_special_tokens)
        try:
            return SamplingParams.from_dict(values)
        except ValueError as exc:
            message = str(exc)
            raise BadRequest(message, next((n for n in (*names, "max_tokens", "seed", "logprobs")
                                            if message.startswith(n)), None)) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's
    grammar: str | None = None  # llama.cpp's (GBNF; Lark is taken too)

    def constraints(self) -> dict[str, StructuredOutputsParams]:
        found = super().constraints()
        if self.json_schema is not None:
            found["json_schema"] = _constraint("json_schema", {"json": self.json_schema})
        if self.grammar is not None:
            found["grammar"] = _constraint("grammar", {"grammar": self.grammar})
        return found

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def check_supported(self) -> None:
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(f"best_of other than n is not supported (best_of = {self.best_of}, n = {self.n})",
                             "best_of")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; an object is taken as it is


class ToolCall(BaseModel):
    """A call in an assistant message sent back in the history."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction
    index: StrictInt | None = None  # as streamed deltas carry it

    def as_template_call(self) -> dict[str, Any]:
        """Arguments as an object: templates write them out themselves (a string would be encoded twice)."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise BadRequest(f"tool call arguments must be a JSON object, got {arguments!r}",
                                 "messages") from None
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content
    # what OpenAI's SDK sends back of a returned message; nothing here depends on them
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Image, audio or file parts are refused by name: kvlm runs language models on text (a multimodal model's
        towers are not loaded)."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(f"content part type {kind!r} is not supported: kvlm reads text parts only "
                                     f"(no image, audio or file input)")
        return content

    def as_template_message(self, content_format: str) -> dict[str, Any]:
        """The message as a chat template reads it; text parts as the template takes content (Tokenizer.
        content_format): kept as parts for a template that loops over them, else joined by newlines (as vLLM)."""
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise BadRequest(f"a {self.role} message needs content (only an assistant message with tool calls may "
                             "have none)", "messages")
        content = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} for part in content] if content_format == "openai" else \
                "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        for field in ("name", "tool_call_id"):
            if getattr(self, field) is not None:
                message[field] = getattr(self, field)
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format; llama.cpp's `{"type": "json_object", "schema": {...}}` too."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return _constraint("response_format", {"json": self.schema_} if self.schema_ else {"json_object": True})
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise BadRequest("response_format of type json_schema needs json_schema.schema", "response_format")
        return _constraint("response_format", {"json": self.json_schema.schema_})


def _constraint(field: str, values: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{field}: {exc}", field) from None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatTemplateFields(BaseModel):
    """How messages become a prompt; chat_template_kwargs is vLLM's extra, e.g. {"enable_thinking": false}."""

    model_config = ConfigDict(extra="forbid")
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        try:
            return checked_template_kwargs(self.chat_template_kwargs or {}, "chat_template_kwargs")
        except ValueError as exc:
            raise BadRequest(str(exc), "chat_template_kwargs") from None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's; passed to the template as vLLM passes it (gpt-oss's writes "Reasoning: high" in its system message)
    reasoning_effort: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    include_reasoning: StrictBool = True  # vLLM's: False drops reasoning_content from the response

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, with reasoning_effort (which may also come in them, but not with another value)."""
        kwargs = super().template_kwargs()
        effort = self.reasoning_effort
        if effort is None:
            return kwargs
        if effort not in REASONING_EFFORTS:
            raise BadRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                             "reasoning_effort")
        if kwargs.get("reasoning_effort", effort) != effort:
            raise BadRequest(f"reasoning_effort is {effort!r} but chat_template_kwargs gives "
                             f"{kwargs['reasoning_effort']!r}; give one of them", "reasoning_effort")
        return {**kwargs, "reasoning_effort": effort}

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    def effective_tool_choice(self) -> str | None:
        """"none", "auto", "required" or a function's name, checked against `tools` as vLLM and OpenAI do."""
        choice = self.tool_choice
        if choice is not None and self.tools is None:
            raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice is None:
            return "auto" if self.tools else "none"
        if choice == "required" and not self.tools:
            return "none"  # OpenAI's behaviour for an empty tool list
        if isinstance(choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools]
            if choice.function.name not in names:
                raise BadRequest(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                 f"the tools: {names}", "tool_choice")
            return choice.function.name
        return choice

    def logprobs_count(self) -> int | None:
        """How many alternatives per token the engine must return (None: no logprobs at all)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise BadRequest(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def checked_max_tokens(requested: int | None, n_prompt: int, n_ctx: int, field: str,
                       prompt_field: str = "prompt") -> int:
    """max_tokens as the engine gets it: what is left of the context when not given; refused if over it."""
    if n_prompt + 1 > n_ctx:
        raise BadRequest(f"This model's maximum context length is {n_ctx} tokens, but the prompt has {n_prompt} "
                         f"tokens (at least one more is needed for the completion)", prompt_field,
                         code="context_length_exceeded")
    if requested is None:
        return n_ctx - n_prompt
    if requested < 1:
        raise BadRequest(f"{field} must be at least 1, got {requested}", field)
    if n_prompt + requested > n_ctx:
        raise BadRequest(f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                         f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the "
                         f"completion). Please reduce the length of the prompt or the completion.", field,
                         code="context_length_exceeded")
    return requested


for _request in (SamplingFields, CompletionRequest, ChatCompletionRequest):
    _request.model_rebuild()  # their response_format is defined below them
