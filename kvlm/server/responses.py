"""OpenAI's response bodies: whole completions, stream chunks, logprobs and usage, as plain dicts."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kvlm.sampling.sampler import SampledToken
from kvlm.tool_calls.chat_output import ChatOutputSpec
from kvlm.text.tokenizer import Tokenizer


@dataclass
class Reply:
    """The identity shared by every chunk of one response."""

    kind: str    # "text_completion" or "chat.completion"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        prefix = "cmpl" if self.kind == "text_completion" else "chatcmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex}"

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def body(self, choices: list[dict], usage: dict | None) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
               output: ChatOutputSpec | None = None) -> dict:
        if self.chat:
            message, finish_reason = output.message(text, finish_reason) if output is not None else \
                ({"role": "assistant", "content": text}, finish_reason)
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta(self, index: int, delta: str | dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        """A stream chunk's choice: for chat `delta` is OpenAI's delta object, for completions the text."""
        if self.chat:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage, with the prompt tokens the prefix cache served (of n choices sharing a prompt: the most)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class LogprobsFormatter:
    """Sampled tokens as OpenAI logprobs: the completions layout or the chat layout."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def next_offset(self, logprobs: dict | None, offset: int) -> int:
        """Where the next token's text_offset starts in the completions layout: after these tokens' pieces."""
        if logprobs is None or self.chat:
            return offset
        return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    def format(self, tokens: list[SampledToken], text_offset: int = 0) -> dict | None:
        if not tokens:
            return None
        return self._chat(tokens) if self.chat else self._completion(tokens, text_offset)

    def _chat(self, tokens: list[SampledToken]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            # bytes are the token's own, so a character split over tokens can be put back together
            return {"token": self.piece(token_id), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token_id))}

        return {"content": [{**entry(t.token_id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or []]} for t in tokens],
                "refusal": None}

    def _completion(self, tokens: list[SampledToken], text_offset: int) -> dict:
        pieces = [self.piece(t.token_id) for t in tokens]
        offsets, at = [], text_offset
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{self.piece(i): lp for i, lp in t.top_logprobs or []} for t in tokens],
                "text_offset": offsets}
