"""One generation request as the engine tracks it, and what it hands back to callers."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from kvlm.sampling.sampler import RequestSampler, SampledToken
from kvlm.sampling.params import SamplingParams
from kvlm.engine.pooling import Pooler
from kvlm.engine.stop import StopChecker
from kvlm.speculative.stats import SpecStats
from kvlm.structured.request_grammar import RequestGrammar


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampler: RequestSampler
    stop: StopChecker
    grammar: RequestGrammar | None = None  # a structured-output constraint
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    seq_id: int | None = None
    n_computed: int = 0            # tokens whose K/V this request's sequence holds
    n_cached_tokens: int = 0       # of those, lent by the prefix cache (counted once per admission)
    n_preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    speculation: SpecStats = field(default_factory=SpecStats)  # its guesses verified and accepted
    pooler: Pooler | None = None  # an embedding request: its prompt pooled, nothing generated
    priority: int = 0  # under the priority scheduling policy: lower runs first
    embedding: list[float] | None = None

    @property
    def token_ids(self) -> list[int]:
        """Everything the sequence holds or will hold: the prompt, then what was generated."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def n_pending(self) -> int:
        """Tokens still to run through the model; 1 for a request in its decode phase."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.n_computed

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def ready(self) -> bool:
        """Whether it can be scheduled: not waiting for its grammar to compile."""
        return self.grammar is None or self.grammar.ready


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, and the last event of a stream."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SampledToken] | None = None
    error: str | None = None
    n_cached_tokens: int = 0
    time_to_first_token: float | None = None
    decode_seconds: float | None = None  # from the first token to the last
    # LLM.chat with tools or a reasoning template: the assistant message as OpenAI's API returns it (content,
    # tool_calls, reasoning_content); finish_reason is then OpenAI's too ("tool_calls" after calls)
    message: dict | None = None
    speculation: SpecStats | None = None  # with speculative decoding: its guesses verified and accepted
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it (None for EOS)
    embedding: list[float] | None = None  # an embedding request's pooled, L2-normalized vector

    @property
    def timings(self) -> dict[str, float]:
        """Prompt tokens computed (cache hits excluded) per second to the first token; decode tokens per second;
        with speculative decoding, the mean tokens per verification round (1 + accepted guesses per round)."""
        computed = len(self.prompt_token_ids) - self.n_cached_tokens
        decoded = len(self.token_ids) - 1
        timings = {
            "prefill_tokens_per_s": computed / self.time_to_first_token if self.time_to_first_token else 0.0,
            "decode_tokens_per_s": decoded / self.decode_seconds if self.decode_seconds and decoded > 0 else 0.0,
        }
        if self.speculation is not None:
            timings["draft_n"] = self.speculation.num_draft_tokens  # (llama.cpp's server names)
            timings["draft_n_accepted"] = self.speculation.num_accepted_tokens
            timings["mean_acceptance_length"] = self.speculation.mean_acceptance_length
        return timings

    @classmethod
    def of(cls, request: Request) -> RequestOutput:
        ttft = None if request.first_token_time is None else request.first_token_time - request.arrival_time
        decode = None if request.finish_time is None or ttft is None else request.finish_time - request.first_token_time
        return cls(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            text=request.stop.text, token_ids=list(request.output_token_ids), finish_reason=request.finish_reason,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            error=request.error, n_cached_tokens=request.n_cached_tokens, time_to_first_token=ttft,
            decode_seconds=decode, speculation=request.speculation if request.speculation.num_drafts else None,
            stop_reason=request.stop.stop_reason, embedding=request.embedding,
        )


@dataclass
class StepEvent:
    """New output of one request in one engine step: the text it completed, and whether it is done."""

    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[SampledToken] | None = None  # when the request asked for logprobs
