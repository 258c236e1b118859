"""What parsing a model's output gives: content and tool calls, whole or as certain prefixes while streaming.

Arguments are JSON text, as `json.dumps(arguments, ensure_ascii=False)` writes them: OpenAI's wire form, with
non-ASCII characters unescaped (escaped arguments made clients imitate the escapes, and broke streamed diffs
in vLLM). Calls get their ids here, so the streamed and the whole parse of an output give calls of one shape.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 24


class Malformed(ValueError):
    """Text that cannot be (or become) a call in the format; the parsers leave it as content."""


def new_call_id() -> str:
    """OpenAI's style of id, `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(ID_LENGTH))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # text outside the calls; None when there is none but whitespace
    calls: list[ToolCall]


@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is certain: the name once whole, and a prefix of the final arguments text."""
    name: str | None
    arguments: str = ""


@dataclass(frozen=True)
class PartialOutput:
    """Certain prefixes of the content and of each call; at the end of the output, the whole of them."""
    content: str
    calls: list[PartialCall]

    def finished(self) -> ParsedOutput:
        """The final parse; every call is whole by then."""
        return ParsedOutput(self.content if self.content.strip() else None,
                            [ToolCall(call.name or "", call.arguments) for call in self.calls])
