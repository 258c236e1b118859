"""vLLM's `speculative_config`, checked: which proposer guesses the next tokens, and how many at most.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"model": "smollm2-135m", "num_speculative_tokens": 4}                # method "draft_model" implied

kvlm adds one key of its own, `adaptive` (default true): the engine measures what verifying k + 1 rows costs
against one and follows each request's acceptance, so it guesses only as many tokens as pay (none on text where
guesses fail). `"adaptive": false` always verifies every guess (for tests and measurements).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Any = None  # the draft model: a known name, a GGUF file, a Hugging Face folder, or a loaded Model
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported (supported: "
                             f"{', '.join(METHODS)})")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"speculative_config num_speculative_tokens {self.num_speculative_tokens} is above "
                             "the limit of 32")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: a draft model is given by \"model\", with method \"draft_model\" "
                             f"or none (got method {self.method!r}, model {self.model!r})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict (vLLM's keys), a JSON object as text, or an existing config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown} (known: {', '.join(sorted(_KEYS))})")
        fields = dict(value)
        if "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config needs num_speculative_tokens (the most tokens guessed per step)")
        fields.setdefault("method", "draft_model" if fields.get("model") is not None else "ngram")
        return cls(**fields)
