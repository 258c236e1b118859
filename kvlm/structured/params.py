"""What a request asks its output to match, in vLLM's `StructuredOutputsParams` shape.

Exactly one constraint per request: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON
object, vLLM's "JSON mode"), `regex`, `choice` (one of the strings, literally), or `grammar` (Lark, or GBNF:
a grammar with `::=` rules is read as GBNF, as llama.cpp writes them). `disable_any_whitespace` makes JSON
compact; otherwise whitespace between JSON tokens is allowed but bounded (`MAX_JSON_WHITESPACE` characters),
so a model cannot run on with spaces until max_tokens.
"""
from __future__ import annotations

import json as json_module
from dataclasses import dataclass, field
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(CONSTRAINTS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured outputs json must be a JSON schema (an object or its text), got "
                             f"{type(self.json).__name__}")
        if isinstance(self.json, str):
            try:
                schema = json_module.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured outputs json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured outputs json must be a JSON schema object, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured outputs choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured outputs choice must hold non-empty strings, got {list(self.choice)!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool) or not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured outputs json_object and disable_any_whitespace must be true or false")

    @classmethod
    def from_dict(cls, values: Any) -> StructuredOutputsParams:
        if isinstance(values, StructuredOutputsParams):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(values).__name__}")
        known = {*CONSTRAINTS, "disable_any_whitespace"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**{key: value for key, value in values.items() if value is not None})

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: the kind, the spec as canonical text, the whitespace option."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json_module.loads(value) if isinstance(value, str) else value
            value = json_module.dumps(value, sort_keys=True)
        elif self.kind == "choice":
            value = json_module.dumps(list(value))
        return self.kind, str(value), self.disable_any_whitespace
