"""One request's constraint as the engine steps it: compiling, then a matcher that masks and follows tokens.

While a reasoning model thinks, its output is free: the grammar constrains only what follows the end of the
reasoning (`</think>`), as vLLM's structured output does with a reasoning parser. Whether an output reasons
is known only from its first token (does it open `<think>`?), so that token is free; when it does not open
reasoning, the matcher starts by following it (and the request fails, naming the grammar's complaint, in the
rare case it does not fit).

A `Triggered` constraint waits for its trigger, as llama.cpp's lazy grammars do: the output is free until the
trigger appears in it (a tool call's opening marker, under tool_choice auto); the matcher then follows the output's
text from the trigger on, and constrains every token after. Where that text does not fit the grammar (it cannot
begin a call after all), the output stays free.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from kvlm.structured.compiler import GrammarCompiler, GrammarError


@dataclass(frozen=True)
class Triggered:
    """`find(output_text)`: where the constrained text begins (its trigger's start), None until it appears."""

    find: Callable[[str], int | None]


class RequestGrammar:
    def __init__(self, compiling: Future[str], compiler: GrammarCompiler,
                 reasoning_ended: Callable[[str], int | None] | Triggered | None = None) -> None:
        """`reasoning_ended(output_text)`: where the content starts (0: the output does not reason), None while
        the output may still be reasoning; None for a request whose constraint holds from the first token; a
        Triggered for one that waits for its trigger."""
        self._compiling, self._compiler = compiling, compiler
        self._reasoning_ended = reasoning_ended
        self.matcher: llguidance.LLMatcher | None = None
        self._dropped = False  # a trigger whose text did not fit: the output stays free

    @property
    def ready(self) -> bool:
        """Compiled (or failed: `error` says why); a request runs only once this is true."""
        return self._compiling.done()

    @property
    def error(self) -> str | None:
        if not self._compiling.done() or self._compiling.exception() is None:
            return None
        return str(self._compiling.exception())

    def wait(self, timeout: float) -> None:
        try:
            self._compiling.exception(timeout)
        except TimeoutError:
            pass

    def active(self, output_text: str, output_token_ids: list[int]) -> bool:
        """Whether the next token is constrained: once the reasoning (if any) has ended in the output so far, or
        the trigger has appeared."""
        if isinstance(self._reasoning_ended, Triggered):
            return self._triggered(output_text)
        if self.matcher is None:
            content_start = 0 if self._reasoning_ended is None else self._reasoning_ended(output_text)
            if content_start is None:
                return False
            self.matcher = self._compiler.matcher(self._compiling.result())
            if content_start == 0 and output_token_ids:  # no reasoning after all: follow the free first token
                for token_id in output_token_ids:
                    self.accept(token_id)
        return not self.matcher.is_stopped()

    @property
    def untriggered(self) -> bool:
        """A Triggered constraint that masks nothing (yet, or ever: its text did not fit): guessed tokens may pass."""
        return isinstance(self._reasoning_ended, Triggered) and self.matcher is None

    def _triggered(self, output_text: str) -> bool:
        if self._dropped:
            return False
        if self.matcher is None:
            start = self._reasoning_ended.find(output_text)
            if start is None:
                return False
            matcher = self._compiler.matcher(self._compiling.result())
            if not all(matcher.consume_token(t) for t in self._compiler.token_ids(output_text[start:])):
                self._dropped = True
                return False
            self.matcher = matcher
        return not self.matcher.is_stopped()

    def accept(self, token_id: int) -> bool:
        """Follow the sampled token; True when the grammar is complete (nothing but the end may follow)."""
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} does not fit the constraint: {self.matcher.get_error()}")
        return self.matcher.is_stopped()


class TokenMask:
    """The tokens a grammar allows at one step, as llguidance fills them: an int32 bitmask row in which bit i of
    word w stands for token 32 w + i. Testing one token is a bit lookup; the whole bool vector is made on demand."""

    def __init__(self, row: torch.Tensor, vocab_size: int) -> None:
        self._words = row.numpy().copy()  # (the step's bitmask buffer is refilled next step)
        self.vocab_size = vocab_size
        self._tokens: torch.Tensor | None = None

    def allows(self, token_id: int) -> bool:
        return bool((int(self._words[token_id >> 5]) >> (token_id & 31)) & 1)

    def tokens(self) -> torch.Tensor:
        """A bool [vocab_size]: True for each allowed token."""
        if self._tokens is None:
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size]
            self._tokens = torch.from_numpy(bits.view(np.bool_))
        return self._tokens
