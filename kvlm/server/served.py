"""One model as the server serves it: its engine on a thread of its own, the name clients call it by, and the checks
and generation that every API's routes share (chat completions, Responses, Messages)."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvlm.engine.engine import Engine
from kvlm.engine.pooling import checked_pooling
from kvlm.engine.request import RequestOutput, StepEvent
from kvlm.sampling.params import SamplingParams
from kvlm.server.async_engine import AsyncEngine, EngineFailure, Finished
from kvlm.server.chat_turn import ChatTurn, chat_turn
from kvlm.server.metrics import ServerMetrics
from kvlm.server.protocol import BadRequest, ChatCompletionRequest, checked_max_tokens


@dataclass
class Choice:
    """One generation the engine runs for a response: choice `index` of a prompt."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    reasoning_ended: Callable[[str], int | None] | None = None  # see Engine.add_request
    priority: int = 0  # under the priority scheduling policy


class ServedModel:
    def __init__(self, engine: Engine, name: str, pooling: str | None = None) -> None:
        """`pooling`: how its embeddings are pooled (kvlm.engine.pooling); None: as the model's file says."""
        self.engine, self.name = engine, name
        self.pooling = checked_pooling(pooling or engine.model.config.pooling)
        self.metrics = ServerMetrics()
        self.runner = AsyncEngine(engine, self.metrics)
        self.tokenizer = engine.model.tokenizer

    # --- checks ---
    def in_vocabulary(self, ids, field: str) -> None:
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} in {field} is outside the vocabulary [0, {vocab})", field)

    def token_ids(self, prompt: str | list[int], field: str) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise BadRequest(f"{field} must not be empty", field)
        self.in_vocabulary(ids, field)
        return ids

    def priority_checked(self, priority: int) -> int:
        try:
            self.engine.check_priority(priority)
        except ValueError as exc:
            raise BadRequest(str(exc), "priority") from None
        return priority

    def sampling_checked(self, params: SamplingParams) -> SamplingParams:
        self.in_vocabulary((params.logit_bias or {}).keys(), "logit_bias")
        return params

    # --- chat ---
    async def chat_turn(self, body: ChatCompletionRequest, prompt_field: str = "messages") -> ChatTurn:
        turn = await chat_turn(self.tokenizer, self.engine.grammars, body)
        self.in_vocabulary(turn.prompt_token_ids, prompt_field)
        return turn

    def chat_choices(self, body: ChatCompletionRequest, turn: ChatTurn, max_tokens_field: str,
                     prompt_field: str = "messages") -> list[Choice]:
        """The request's n choices of the turn; max_tokens checked against the context (400 on `max_tokens_field`)."""
        ids = turn.prompt_token_ids
        max_tokens = checked_max_tokens(body.requested_max_tokens(), len(ids), self.engine.n_ctx, max_tokens_field,
                                        prompt_field)
        logprobs, priority = body.logprobs_count(), self.priority_checked(body.priority)
        skip_special_tokens = not turn.output.keeps_special_tokens
        return [Choice(i, ids, self.sampling_checked(body.sampling_params(max_tokens, logprobs, i, turn.constraint,
                                                                          skip_special_tokens)),
                       turn.reasoning_ended, priority)
                for i in range(body.n_choices())]

    # --- generation ---
    def events(self, request_id: str, choice: Choice) -> AsyncIterator[StepEvent | Finished]:
        """The choice's engine events, then `Finished`; leaving early aborts it."""
        return self.runner.generate(request_id, choice.prompt_token_ids, choice.params, choice.reasoning_ended,
                                    priority=choice.priority)

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> RequestOutput:
        """The prompt's embedding (`embedding` of the output), computed beside the generating requests."""
        return await finished(self.runner.generate(request_id, prompt_token_ids, SamplingParams(max_tokens=1),
                                                   pooling=self.pooling))

    async def run(self, request_id: str, choice: Choice) -> RequestOutput:
        """The choice's whole output (with `error` set where the engine refused it, e.g. too long)."""
        return await finished(self.events(request_id, choice))


async def finished(events: AsyncIterator[StepEvent | Finished]) -> RequestOutput:
    """A request's last event's output."""
    async for item in events:
        if isinstance(item, Finished):
            return item.output
    raise EngineFailure("the engine stopped before the request finished")
