"""What one request asks of sampling, with vLLM's names, defaults and checks.

Differences from vLLM's `SamplingParams`, all deliberate:

- Only the fields below exist (no `n`, `best_of`, `min_tokens`, `include_stop_str_in_output`, ...).
- `structured_outputs` may also be given as a dict of `StructuredOutputsParams` fields.
- `max_tokens` must be an int >= 1; vLLM also takes None ("until the context is full").
- `stop` and `stop_token_ids` are stored as tuples and `logit_bias` as a copied dict, so a params object is
  hashable (`logit_bias` is left out of the hash) and cannot change under a running request.
- `logprobs` has no upper cap (vLLM caps it at the engine's `max_logprobs`, 20 by default); the sampler
  returns at most vocabulary-size entries.
- Float fields must be finite (vLLM lets e.g. an infinite temperature through); `seed` must fit a
  torch generator seed, [-2**63, 2**64).
- `logit_bias` is checked here (int token ids >= 0, values in [-100, 100], as the OpenAI API allows);
  vLLM's OpenAI server clamps out-of-range values instead. Whether the ids are inside the vocabulary is
  only known to the sampler, which raises ValueError at the first step.
- `top_k` is kept as given; -1 and 0 both mean "off" (vLLM turns -1 into 0).

As in vLLM, a temperature below 1e-5 means greedy decoding (top_k, top_p and min_p are then moot), and
so does top_k == 1.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvlm.structured.params import StructuredOutputsParams

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request; invalid values raise ValueError naming the field."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: the output text leaves out special tokens. A chat whose output is read by its markers sets it False
    # where those markers are special tokens (gpt-oss's harmony channels); a stop token's text is never emitted.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def set_(name: str, value: Any) -> None:  # frozen: normalised values go past __setattr__
            object.__setattr__(self, name, value)

        set_("max_tokens", _integer("max_tokens", self.max_tokens))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        set_("temperature", _real("temperature", self.temperature))
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be non-negative (0 = greedy), got {self.temperature}")
        set_("top_k", _integer("top_k", self.top_k))
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled), or at least 1, got {self.top_k}")
        set_("top_p", _real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        set_("min_p", _real("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        set_("repetition_penalty", _real("repetition_penalty", self.repetition_penalty))
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            set_(name, value)
        set_("logit_bias", _logit_bias(self.logit_bias))
        if self.seed is not None:
            set_("seed", _integer("seed", self.seed))
            if not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
                raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        set_("stop", _stop_strings(self.stop))
        set_("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            set_("logprobs", _integer("logprobs", self.logprobs))
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.structured_outputs is not None:
            set_("structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """From a JSON object: unknown keys are errors, null means the default, logit_bias keys may be strings."""
        if not isinstance(values, Mapping):
            raise ValueError(f"sampling parameters must be an object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
        kwargs = {key: value for key, value in values.items() if value is not None}
        if isinstance(kwargs.get("logit_bias"), Mapping):  # JSON object keys are always strings
            kwargs["logit_bias"] = {_json_token_id(key): value for key, value in kwargs["logit_bias"].items()}
        return cls(**kwargs)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature (near) 0, or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
    checked = {}
    for token_id, value in bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
        value = _real(f"logit_bias[{token_id}]", value)
        if not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token_id}")
        checked[int(token_id)] = value
    return checked or None


def _json_token_id(key: Any) -> Any:
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}") from None
    return key


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in strings:
        if not isinstance(s, str):
            raise ValueError(f"stop must be a string or a list of strings, got {s!r} in it")
        if not s:
            raise ValueError("stop cannot contain an empty string")
    return tuple(strings)


def _stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
    checked = tuple(_integer("stop_token_ids", i) for i in ids)
    if any(i < 0 for i in checked):
        raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {list(checked)}")
    return checked
