"""Constraints compiled to llguidance grammars for one model's tokenizer, cached by spec.

llguidance builds its token trie from the `tokenizers` JSON kvlm already holds, so the vocabulary it masks is
exactly the one kvlm encodes and decodes with. Compiling drops the GIL; the engine compiles on worker threads
(`submit`) and a request waits for its grammar without holding up the step.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from kvlm.structured.params import StructuredOutputsParams
from kvlm.text.tokenizer import Tokenizer

# Whitespace between JSON tokens: any of the four JSON whitespace characters, at most this many in a row.
# Unbounded whitespace is the most reported structured-output failure (a model that spaces until max_tokens).
MAX_JSON_WHITESPACE = 8
JSON_WHITESPACE = f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"
log = logging.getLogger("kvlm")
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the kind and the compiler's reason."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a constraint; not yet checked."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        options = ({"whitespace_flexible": False} if params.disable_any_whitespace
                   else {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE})
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise GrammarError(f"json schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":  # literals, not patterns: JSON string escapes are Lark's
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice))
    lark = params.grammar
    if "::=" in lark:  # llama.cpp's GBNF
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            lark = gbnf_to_lark(lark)
        except Exception as exc:  # the converter raises plain exceptions on syntax it cannot read
            raise GrammarError(f"grammar (GBNF): {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer: masks of `vocab_size` bits (the model's logits, which may be
    wider than the tokenizer: padded ids are never allowed); the grammar's end accepts any stop token."""
    stop_ids = sorted(tokenizer.stop_ids) or None
    return llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=stop_ids)


class GrammarCompiler:
    """Compiles constraints for one model; thread-safe; compiled grammars are cached by their spec."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, workers: int = 1) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, str] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvlm-grammar")
        self._executor: llguidance.LLExecutor | None = None
        self.compile_seconds = 0.0  # summed over compilations (cache hits excluded)
        self.n_compiled = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = ll_tokenizer(self._tokenizer, self.vocab_size)
            return self._ll_tokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        """Fills a step's masks without the GIL; one thread, so it never competes with the model for cores."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(1)
        return self._executor

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar for `params`; GrammarError when it cannot compile."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        start = time.perf_counter()
        grammar = grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"{params.kind} constraint cannot be compiled: {messages[0]}")
        seconds = time.perf_counter() - start
        log.info("compiled a %s constraint in %.1f ms", params.kind, seconds * 1e3)
        with self._lock:
            self.compile_seconds += seconds
            self.n_compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def submit(self, params: StructuredOutputsParams) -> Future[str]:
        return self._pool.submit(self.compile, params)

    def special_tokens(self, texts: tuple[str, ...]) -> set[str]:
        """Those of `texts` that are one special token of the vocabulary (a grammar names them as tokens)."""
        found = set()
        for text in texts:
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
                found.add(text)
        return found

    def token_ids(self, text: str) -> list[int]:
        """`text` as the model's tokenizer encodes it (special tokens written in it read as those tokens)."""
        return self._tokenizer.encode(text, add_special_tokens=False)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar cannot be compiled: {matcher.get_error()}")
        return matcher
