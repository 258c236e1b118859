"""OpenAI's request bodies as pydantic models, and their mapping onto `SamplingParams`.

Unknown fields are refused (400) rather than ignored, so a client never believes a setting took effect
when it did not. Besides OpenAI's fields, vLLM's extras are accepted: top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, and for chat chat_template_kwargs.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kvlm.engine.sampling_params import SamplingParams
from kvlm.tokenizer import checked_template_kwargs

MAX_N = 16  # choices per request
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 4, 256  # OpenAI takes up to 4 stop sequences
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs


class BadRequest(ValueError):
    """A request the server refuses with 400 (or `status`); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


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
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None

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

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """The engine's params for choice `choice` of n: with a seed, choice i samples with seed + i."""
        self._check_limits(logprobs)
        names = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "logit_bias", "stop", "top_k",
                 "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
        values: dict[str, Any] = {name: getattr(self, name) for name in names}
        values.update(max_tokens=max_tokens, logprobs=logprobs,
                      seed=None if self.seed is None else self.seed + choice)
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


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
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None

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
