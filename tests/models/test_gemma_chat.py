"""Gemma 3's chat template: the base Gemma 3 270M GGUF carries none, so kvlm gives it Google's own (the family's
default), rendered, tokenized and generated from as transformers does with that template; a file's own template wins.

The base model never learned to end a turn (it writes some other token where <end_of_turn> would go), so the test
that a chat generation stops at <end_of_turn> nudges that token up with a logit bias, in kvlm and in transformers alike.
"""
from __future__ import annotations

import json

import jinja2
import pytest
import torch


from kvlm import LLM, SamplingParams, load_model
from kvlm.families import gemma3
from kvlm.text.tokenizer import Tokenizer

BOS, EOS, START_OF_TURN, END_OF_TURN = 2, 1, 105, 106
NEW_TOKENS = 16

SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a fruit."},
]
# Contents with spaces and newlines around them (the template trims them), and a system message given as parts.
ENDS_WITH_THE_MODEL = [
    {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
    {"role": "user", "content": [{"type": "text", "text": "  2 + 2?\n"}]},
    {"role": "assistant", "content": "\n4  "},
]
USER_ONLY = [{"role": "user", "content": "Écris un haïku sur la mer. 🌊"}]

RENDERED = [
    (SYSTEM_AND_USER, True),
    (SYSTEM_AND_USER, False),
    (MULTI_TURN, True),
    (MULTI_TURN + [{"role": "assistant", "content": "An apple."}], False),
    (ENDS_WITH_THE_MODEL, False),
    (ENDS_WITH_THE_MODEL + [{"role": "user", "content": "And 3 + 3?"}], True),
    (USER_ONLY, True),
]


@pytest.fixture(scope="module")
def hf_tokenizer(hf_gemma_tokenizer):
    return hf_gemma_tokenizer


@pytest.fixture(scope="module")
def llm(gemma_gguf_path) -> LLM:
    return LLM(load_model(str(gemma_gguf_path), "float32"), n_ctx=256, max_num_seqs=2)


@pytest.fixture(scope="module")
def hf_model(hf_gemma):
    return hf_gemma


# --- the template ---

def test_the_base_file_has_no_template_and_gets_gemmas(metadata, tokenizer):
    assert "tokenizer.chat_template" not in metadata and metadata["general.architecture"] == "gemma3"
    assert tokenizer.chat_template == gemma3.FAMILY.default_chat_template == gemma3.CHAT_TEMPLATE


def test_the_format(tokenizer):
    assert tokenizer.apply_chat_template(SYSTEM_AND_USER) == (
        "<bos><start_of_turn>user\nYou are a helpful assistant. Answer briefly.\n\nWhat is the capital of France?"
        "<end_of_turn>\n<start_of_turn>model\n"
    )
    assert tokenizer.apply_chat_template(ENDS_WITH_THE_MODEL, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nBe terse.\n\n2 + 2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
    )


@pytest.mark.parametrize(("messages", "add_generation_prompt"), RENDERED)
def test_prompt_and_ids_match_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=gemma3.CHAT_TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    ids = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert ids[:2] == [BOS, START_OF_TURN] and ids.count(BOS) == 1  # the template's BOS, and no second one


def test_roles_must_alternate(tokenizer):
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# --- a file's own template wins ---

MADE_UP = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_a_gguf_with_its_own_template_keeps_it(metadata):
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": MADE_UP})
    assert tokenizer.chat_template == MADE_UP
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_hf_folder_without_a_template_gets_the_familys_and_one_with_a_template_keeps_it(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)  # tokenizer.json and tokenizer_config.json, no template (the GGUF has none)
    assert not (tmp_path / "chat_template.jinja").exists()
    assert Tokenizer.from_hf_folder(tmp_path).chat_template is None  # no config.json: no family to ask
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"],
                                                      "model_type": "gemma3_text"}))
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == gemma3.CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text(MADE_UP)
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == MADE_UP


# --- generation from a chat prompt, against transformers' greedy generate ---

def test_end_of_turn_is_a_stop_token(tokenizer):
    assert tokenizer.encode("<end_of_turn>", add_special_tokens=False) == [END_OF_TURN]
    assert tokenizer.stop_ids == frozenset({EOS, END_OF_TURN})


def _reference_greedy(hf_model, ids: list[int], stop_ids, **kwargs) -> list[int]:
    """transformers' greedy continuation, cut after the first token kvlm stops at."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    tokens = out[0, len(ids):].tolist()
    ends = [i for i, token in enumerate(tokens) if token in stop_ids]
    return tokens[: ends[0] + 1] if ends else tokens


def test_greedy_chat_continuation_equals_transformers(llm, hf_model):
    conversations = [SYSTEM_AND_USER, MULTI_TURN]
    outputs = llm.chat(conversations, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)
    for messages, output in zip(conversations, outputs):
        assert output.prompt_token_ids == llm.tokenizer.encode_chat(messages)
        expected = _reference_greedy(hf_model, output.prompt_token_ids, llm.tokenizer.stop_ids)
        assert output.token_ids == expected and len(expected) == NEW_TOKENS


def test_a_chat_generation_stops_at_end_of_turn(llm, hf_model):
    """A bias of 15 makes <end_of_turn> the greedy pick only where the base model ends its answer (its margin
    there is about 9.5, at least 24 before), in transformers too, which is told to stop at it."""
    bias = 15.0
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logit_bias={END_OF_TURN: bias})
    output = llm.chat(MULTI_TURN, params, use_tqdm=False)[0]
    expected = _reference_greedy(hf_model, output.prompt_token_ids, {EOS, END_OF_TURN},
                                 sequence_bias={(END_OF_TURN,): bias}, eos_token_id=[EOS, END_OF_TURN])
    assert output.token_ids == expected
    assert output.token_ids[-1] == END_OF_TURN and 1 < len(output.token_ids) < NEW_TOKENS
    assert output.finish_reason == "stop" and output.text == "Hello! How can I help?"
