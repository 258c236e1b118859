"""One request's output text as it grows, and whether a stop token or stop string has ended it.

- A token in `eos_ids` (unless `ignore_eos`) or in `stop_token_ids` ends the request with reason 'stop';
  its own text is not emitted.
- A stop string is found across token boundaries; the text is cut right before it, and neither it nor
  anything after it is emitted. Of several stop strings in the text, the one starting first wins.
- Text that could still be the start of a stop string is held back until the next tokens show whether it
  is; only the part that could be is held, not a fixed number of characters.
- Text comes from `StreamDecoder` (special tokens left out unless `params.skip_special_tokens` is False), so no
  piece ends in half a UTF-8 character.
  The decoder holds a token's whole text while it ends in an unfinished character, so a stop string
  followed in the same token by the first bytes of a character is found when that character completes
  (vLLM's detokenizer does the same); the text is cut at the same place.

The 'length' end is the caller's: at `max_tokens` tokens (the request cannot go on) the held-back text is
released with that token's text; a request ended for any other reason (context full, abort) gets its
held-back text from `finish()`. Bytes of a character that never completed are dropped at the end rather
than emitted as U+FFFD.

Differences from vLLM: vLLM checks stop strings in list order (the first listed one found wins, not the
first in the text) and, when streaming, holds back the last len(longest stop string) - 1 characters
whatever they are; `stop_reason` follows vLLM (the stop string or stop token id, None for EOS).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlm.sampling.params import SamplingParams
from kvlm.text.tokenizer import StreamDecoder, Tokenizer

_INCOMPLETE = "\N{REPLACEMENT CHARACTER}"


@dataclass(frozen=True, slots=True)
class StopResult:
    new_text: str  # the text this token adds to the output, possibly empty
    finished: bool = False
    finish_reason: str | None = None  # 'stop' when finished
    stop_reason: str | int | None = None  # the stop string or stop token id that matched; None for EOS


class StopChecker:
    """Per request: feed each generated token to `add`; `text` is the output so far."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, eos_ids: frozenset[int]) -> None:
        self._decoder = StreamDecoder(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self._stop_strings = params.stop
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._ending_ids = self._stop_token_ids | (frozenset() if params.ignore_eos else frozenset(eos_ids))
        # Every proper prefix of a stop string: a text ending in one of them may be a stop string's start.
        self._prefixes = {s[:i] for s in self._stop_strings for i in range(1, len(s))}
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
        self._max_tokens = params.max_tokens
        self._n_tokens = 0
        self._held = ""  # decoded but not emitted: it may be the start of a stop string
        self._pieces: list[str] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far (without the stop string and without held-back text)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> StopResult:
        """The text `token_id` adds, and whether it ends the request."""
        if self.finished:
            raise RuntimeError("this request's output is finished; no more tokens can be added")
        self._n_tokens += 1
        if token_id in self._ending_ids:
            reason = token_id if token_id in self._stop_token_ids else None
            return self._stop(self._release(), reason)
        text = self._held + self._decoder.feed(token_id)
        if self._stop_strings:
            match = self._first_stop_string(text)
            if match is not None:
                start, stop_string = match
                return self._stop(text[:start], stop_string)
            hold = self._held_back_length(text)
            text, self._held = text[: len(text) - hold], text[len(text) - hold :]
        if self._n_tokens >= self._max_tokens:
            text += self._release()  # the caller ends the request here ('length'): nothing may stay behind
        return StopResult(self._emit(text))

    def finish(self) -> str:
        """End the output for a reason the checker did not see: the text still held back, now released."""
        if self.finished:
            return ""
        self.finished = True
        return self._emit(self._release())

    def _stop(self, text: str, stop_reason: str | int | None) -> StopResult:
        self.finished, self.finish_reason, self.stop_reason = True, "stop", stop_reason
        return StopResult(self._emit(text), True, "stop", stop_reason)

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text

    def _release(self) -> str:
        """Held-back text and whatever the decoder still has, minus the bytes of an unfinished character."""
        text = self._held + self._decoder.flush().rstrip(_INCOMPLETE)
        self._held = ""
        return text

    def _first_stop_string(self, text: str) -> tuple[int, str] | None:
        found = None
        for stop_string in self._stop_strings:
            start = text.find(stop_string)
            if start >= 0 and (found is None or start < found[0]):
                found = (start, stop_string)
        return found

    def _held_back_length(self, text: str) -> int:
        """The length of the longest end of `text` that a stop string starts with."""
        for length in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0
