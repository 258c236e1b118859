"""tool_choice auto keeps calls right (llama.cpp's lazy grammars): once a model opens a call in its format, the rest
of the call is constrained by the offered tools' names and parameter schemas, for every format kvlm parses.

A tiny random model writes the calls: each run is scripted up to where a call opens (prose, then the format's
opening marker), then samples freely (temperature 1 over a random model's logits, a new seed per run). Under the lazy
grammar every run's call parses, names an offered tool and validates against its schema; the same runs without it
write calls that do not (the check below that shows the test can fail). Before the call opens the output is free:
the prose is the model's, untouched.
"""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from helpers.gguf_factory import byte_level_vocab, gguf_metadata, gguf_tensors, llama_config, random_llama, write_gguf
from kvlm.engine.engine import Engine
from kvlm.loader.load import load_model
from kvlm.sampling.params import SamplingParams
from kvlm.sampling.sampler import RequestSampler
from kvlm.structured.params import StructuredOutputsParams
from kvlm.tool_calls import gemma4, harmony, hermes, pythonic
from kvlm.tool_calls.chat_output import ChatOutputSpec
from kvlm.tool_calls.tool_choice import plan_tools

BYTE_LEVEL_SIZE = 1000
N_RUNS = 12
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp token types
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
HARMONY_TOKENS = (harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.CONSTRAIN, harmony.END, harmony.CALL,
                  harmony.RETURN)


@dataclasses.dataclass(frozen=True)
class Case:
    template: str  # what the chat template shows (its format is found from it)
    tokens: tuple[str, ...]  # the format's markers, as the format's models have them
    token_type: int  # user-defined (kept in the output text) or control (special)
    opening: str  # the scripted output, up to and including where the call opens
    keeps_special_tokens: bool = False
    not_a_call: str = "Sunny."  # an answer that opens no call (for whole-output formats: one that looks close)


CASES = {
    "hermes": Case("{{ '<tool_call>' }}", (hermes.START, hermes.END), _USER_DEFINED,
                   "Let me check that.\n<tool_call>"),
    "qwen3_xml": Case("{{ '<tool_call><function=' }}", (hermes.START, hermes.END), _USER_DEFINED,
                      "Let me check that.\n<tool_call>"),
    "lfm2": Case("{{ '<|tool_call_start|>' }}", (pythonic.LFM2_START, pythonic.LFM2_END), _USER_DEFINED,
                 "Let me check that.<|tool_call_start|>"),
    "pythonic": Case("{{ '[func_name1(' }}", (), _NORMAL, "[get_weather(", not_a_call="[docs](x) and [1, 2]"),
    "llama3_json": Case("{{ '<|python_tag|>' }}", (), _NORMAL, '{"name":', not_a_call='{"answer": 1}'),
    "gemma4": Case(f"{{{{ '{gemma4.START}' }}}}", (gemma4.START, gemma4.END, gemma4.QUOTE), _CONTROL,
                   f"Let me check that.{gemma4.START}", keeps_special_tokens=True),
    # (gpt-oss's reasoning reader keeps the special tokens in the text: kvlm.tool_calls.reasoning)
    "harmony": Case("{{ '<|channel|>analysis<|message|>' }}", HARMONY_TOKENS, _CONTROL,
                    "<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary "
                    "to=functions.", keeps_special_tokens=True),
}
EOS = "<|eot|>"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> tuple[str, Case]:
    return request.param, CASES[request.param]


def _engine(spec: Case, folder, **options) -> Engine:
    tokens, merges = byte_level_vocab(BYTE_LEVEL_SIZE)
    tokens = [*tokens, *spec.tokens, EOS]
    config = llama_config(vocab_size=len(tokens))
    types = [_CONTROL if t == EOS else spec.token_type if t in spec.tokens else _NORMAL for t in tokens]
    metadata = {**gguf_metadata(config), "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.eos_token_id": tokens.index(EOS),
                "tokenizer.chat_template": spec.template}
    path = write_gguf(folder / "tiny.gguf", metadata, gguf_tensors(random_llama(config)))
    return Engine(load_model(str(path), "float32", progress=False), n_ctx=256, max_num_seqs=N_RUNS, **options)


@pytest.fixture(scope="module")
def engine(case, tmp_path_factory) -> Engine:
    name, spec = case
    return _engine(spec, tmp_path_factory.mktemp(name))


@pytest.fixture
def scripted_opening(monkeypatch):
    """Each request's first tokens are forced to the ids set here; after them it samples as it would."""
    opening: list[int] = []
    init, sample = RequestSampler.__init__, RequestSampler.sample

    def counting_init(self, params, prompt_token_ids):
        init(self, params, prompt_token_ids)
        self.n_sampled = 0

    def scripted_sample(self, logits, allowed=None):
        self.n_sampled += 1
        if self.n_sampled <= len(opening):
            logits = torch.full_like(logits, -30.0)
            logits[opening[self.n_sampled - 1]] = 30.0
        return sample(self, logits, allowed)

    monkeypatch.setattr(RequestSampler, "__init__", counting_init)
    monkeypatch.setattr(RequestSampler, "sample", scripted_sample)
    return opening


def run(engine: Engine, case: Case, lazy: bool, prompt: str = "What is the weather?") -> list[tuple[str, dict, str]]:
    """N_RUNS sampled outputs (a seed each) of an auto-mode turn: (text, message, finish_reason)."""
    plan = plan_tools(case.template, TOOLS, "auto", False, engine.grammars.special_tokens)
    assert plan.format is not None and plan.lazy_grammar is not None and plan.forcing_grammar is None
    spec = ChatOutputSpec(None, plan.format, tuple(TOOLS), parallel=False)
    constraint = StructuredOutputsParams(grammar=plan.lazy_grammar) if lazy else None
    prompt_ids = engine.model.tokenizer.encode(prompt, add_special_tokens=False)
    ids = [engine.add_request(prompt_ids, SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                                                     structured_outputs=constraint,
                                                     skip_special_tokens=not case.keeps_special_tokens),
                              reasoning_ended=plan.constraint_start(None) if lazy else None)
           for seed in range(N_RUNS)]
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.release(i) for i in ids]
    return [(o.text, *spec.message(o.text, o.finish_reason)) for o in outputs]


def valid_call(message: dict) -> bool:
    calls = message.get("tool_calls") or []
    if len(calls) != 1 or calls[0]["function"]["name"] not in SCHEMAS:
        return False
    try:
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS[calls[0]["function"]["name"]])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_every_call_opened_under_auto_parses_and_validates(engine, case, scripted_opening):
    name, spec = case
    scripted_opening[:] = engine.model.tokenizer.encode(spec.opening, add_special_tokens=False)
    outputs = run(engine, spec, lazy=True)
    for text, message, finish_reason in outputs:
        assert text.startswith(spec.opening), text  # up to the call the output was free: the script's
        assert valid_call(message), (name, text, message)
        assert finish_reason == "tool_calls", (name, text)
    arguments = {message["tool_calls"][0]["function"]["arguments"] for _, message, _ in outputs}
    assert len(arguments) > 1  # the runs sampled: not one call written twelve times


def test_without_the_grammar_the_same_runs_write_broken_calls(engine, case, scripted_opening):
    """The check that the test above can fail: a random model's free output after the opening is not a call."""
    name, spec = case
    scripted_opening[:] = engine.model.tokenizer.encode(spec.opening, add_special_tokens=False)
    outputs = run(engine, spec, lazy=False)
    assert sum(valid_call(message) for _, message, _ in outputs) < N_RUNS // 2, name


def test_a_free_answer_stays_free(engine, case, scripted_opening):
    """No call opened: no token is masked, the answer is the model's as without tools (for JSON or a list that
    does not open a call too)."""
    name, spec = case
    scripted_opening[:] = engine.model.tokenizer.encode(spec.not_a_call, add_special_tokens=False)
    constrained = run(engine, spec, lazy=True)
    free = run(engine, spec, lazy=False)
    for (text, message, _), (free_text, _, _) in zip(constrained, free):
        assert text.startswith(spec.not_a_call)
        if spec.opening not in text and not message.get("tool_calls"):
            assert text == free_text
    assert any(spec.opening not in text for text, _, _ in constrained)


def test_speculative_guesses_stop_where_a_call_opens(case, tmp_path_factory, scripted_opening):
    """With prompt-lookup guesses (always verified), an auto-mode request guesses while its output is free, takes no
    guessed token after a call opens, and writes what it writes without guesses (seeded sampling included)."""
    name, spec = case
    if name != "hermes":
        pytest.skip("one format is enough: the engine's rule does not depend on it")
    engine = _engine(spec, tmp_path_factory.mktemp("speculative"),
                     speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    plain = _engine(spec, tmp_path_factory.mktemp("plain"))
    scripted_opening[:] = engine.model.tokenizer.encode(spec.opening, add_special_tokens=False)
    # the prompt holds the opening and a call, so lookup guesses them
    prompt = "Last time: " + spec.opening + '\n{"name": "get_weather", "arguments": {"unit": "celsius", "days": 3}}'
    guessed = run(engine, spec, lazy=True, prompt=prompt)
    assert [output[0] for output in guessed] == [output[0] for output in run(plain, spec, lazy=True, prompt=prompt)]
    assert all(valid_call(message) for _, message, _ in guessed)
    assert engine.speculator is not None and engine.speculator.stats.num_drafts > 0
