"""What the tests share that is not a fixture: the random-model factories (`*_factory`: tiny models transformers
builds, written as Hugging Face folders and as GGUF files the way llama.cpp's converters write them), kvlm's logits
and transformers' as the reference (`models`), a live server (`server`), a headless browser (`browser`) and the
helpers of a few topics (`chat`, `tool_calls`, `speculative`, ...). Imported as `from helpers.models import ...`:
tests/conftest.py puts tests/ on sys.path. Fixtures live in the conftest.py files, never here."""
from __future__ import annotations

from pathlib import Path

import kvlm  # noqa: F401  (first: it sets up OpenMP before torch loads)

DATA = Path(__file__).resolve().parent.parent / "data"  # tests/data: the vendored chat templates and schema suite
