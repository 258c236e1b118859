"""An outside judge for JSON constraints: the JSON-Schema-Test-Suite (draft 2020-12, vendored in tests/data).

For every schema kvlm's compiler accepts (coverage), each instance of the suite, written as JSON text and
tokenized by the real SmolLM2 tokenizer, is fed to the constraint's matcher: an instance the suite calls invalid
must never be accepted as a whole output (soundness: a constrained output is always valid). Instances the suite
calls valid may be refused (the constraint is stricter than the schema: properties in the schema's order, no
whitespace beyond the bound); `pytest -s` prints how many, with the coverage.
"""
from __future__ import annotations

import json

import pytest

from helpers import DATA
from kvlm.loader.fetch import DEFAULT_MODEL, pull
from kvlm.loader.gguf_reader import read_gguf_metadata
from kvlm.structured.compiler import GrammarCompiler, GrammarError
from kvlm.structured.params import StructuredOutputsParams
from kvlm.text.tokenizer import Tokenizer

SUITE = DATA / "json_schema_test_suite"


def suite_cases() -> list[tuple[str, dict]]:
    return [(f"{path.stem}: {case['description']}", case) for path in sorted(SUITE.glob("*.json"))
            for case in json.loads(path.read_text(encoding="utf-8"))]


def judge(compiler: GrammarCompiler, tokenizer: Tokenizer, case: dict) -> list[tuple[str, bool, bool]] | None:
    """(instance description, the suite's verdict, whether the constraint accepts it) for each instance; None
    when the schema is not supported (it does not compile)."""
    try:
        grammar = compiler.compile(StructuredOutputsParams(json=json.dumps(case["schema"])))
    except (GrammarError, ValueError):
        return None
    verdicts = []
    for test in case["tests"]:
        matcher = compiler.matcher(grammar)
        ids = tokenizer.encode(json.dumps(test["data"], ensure_ascii=False), add_special_tokens=False)
        accepted = matcher.consume_tokens(ids) and matcher.is_accepting()
        verdicts.append((test["description"], test["valid"], accepted))
    return verdicts


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(pull(DEFAULT_MODEL, progress=False)))


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


def test_no_invalid_instance_is_ever_accepted(compiler, smollm2_tokenizer):
    cases = suite_cases()
    covered, accepted_invalid, n_valid, accepted_valid = 0, [], 0, 0
    for name, case in cases:
        verdicts = judge(compiler, smollm2_tokenizer, case)
        if verdicts is None:
            continue
        covered += 1
        accepted_invalid += [(name, test) for test, valid, accepted in verdicts if accepted and not valid]
        n_valid += sum(valid for _, valid, _ in verdicts)
        accepted_valid += sum(valid and accepted for _, valid, accepted in verdicts)
    print(f"\nJSON-Schema-Test-Suite draft 2020-12: {covered} of {len(cases)} schemas compile; of their valid "
          f"instances {accepted_valid} of {n_valid} accepted; invalid instances accepted: {len(accepted_invalid)}")
    assert covered >= 100  # most of the suite's schemas compile
    assert accepted_invalid == []
