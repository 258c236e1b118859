"""Chat template kwargs (vLLM's chat_template_kwargs, e.g. enable_thinking) through the Tokenizer, `LLM.chat`,
`ChatSession` and the `kvlm generate` / `kvlm chat` commands.

No Qwen3 file is at hand, so SmolLM2 gets a minimal template that ends as Qwen3's own does: with
enable_thinking false, the generation prompt carries an empty think block.
"""
from __future__ import annotations

import io
import json

import pytest

from helpers.chat import NO_THINKING, QWEN3_STYLE_TEMPLATE
import kvlm.cli.commands
import kvlm.engine.llm
from kvlm.engine.chat_session import ChatSession
from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams

MESSAGES = [{"role": "user", "content": "Hi"}]
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture
def thinking_model(smollm2, monkeypatch):
    """SmolLM2 with the Qwen3-style template, for this test only."""
    monkeypatch.setattr(smollm2.tokenizer, "chat_template", QWEN3_STYLE_TEMPLATE)
    return smollm2


@pytest.fixture
def cli_model(thinking_model, monkeypatch):
    """The CLI loads the already loaded model whatever --model says."""
    monkeypatch.setattr(kvlm.cli.commands, "load_model", lambda *args, **kwargs: thinking_model)
    monkeypatch.setattr(kvlm.engine.llm, "load_model", lambda *args, **kwargs: thinking_model)
    return thinking_model


def prompt_text(model, ids: list[int]) -> str:
    return model.tokenizer.decode(ids)


def test_tokenizer_passes_template_kwargs_as_transformers_does(thinking_model, hf_smollm2_tokenizer):
    tokenizer = thinking_model.tokenizer
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        expected = hf_smollm2_tokenizer.apply_chat_template(
            MESSAGES, chat_template=QWEN3_STYLE_TEMPLATE, tokenize=False, add_generation_prompt=True, **kwargs)
        assert tokenizer.apply_chat_template(MESSAGES, **kwargs) == expected
        assert expected.endswith(NO_THINKING) == (kwargs == {"enable_thinking": False})


def test_template_kwargs_override_named_tokens_as_in_transformers(smollm2, hf_smollm2_tokenizer, monkeypatch):
    template = "{{ eos_token }}|{{ documents }}|{{ tools }}"
    monkeypatch.setattr(smollm2.tokenizer, "chat_template", template)
    for kwargs in ({}, {"eos_token": "<end>", "documents": [{"title": "t", "text": "x"}]}):
        expected = hf_smollm2_tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, **kwargs)
        assert smollm2.tokenizer.apply_chat_template(MESSAGES, **kwargs) == expected


def test_llm_chat_passes_chat_template_kwargs(thinking_model):
    llm = LLM(thinking_model, n_ctx=256, max_num_seqs=2)
    thinking = llm.chat(MESSAGES, ONE_TOKEN, use_tqdm=False)[0]
    assert not prompt_text(thinking_model, thinking.prompt_token_ids).endswith(NO_THINKING)
    out = llm.chat(MESSAGES, ONE_TOKEN, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert prompt_text(thinking_model, out.prompt_token_ids).endswith(NO_THINKING)
    assert out.prompt_token_ids == thinking_model.tokenizer.encode_chat(MESSAGES, enable_thinking=False)
    with pytest.raises(ValueError, match="chat_template_kwargs must be a JSON object, got str"):
        llm.chat(MESSAGES, ONE_TOKEN, use_tqdm=False, chat_template_kwargs="enable_thinking=False")


def test_chat_session_passes_chat_template_kwargs_every_turn(thinking_model):
    llm = LLM(thinking_model, n_ctx=512, max_num_seqs=1)
    session = ChatSession(llm, ONE_TOKEN, chat_template_kwargs={"enable_thinking": False})
    for content in ("Hi", "And again"):
        list(session.send(content))
        assert prompt_text(thinking_model, session.last_output.prompt_token_ids).endswith(NO_THINKING)


@pytest.mark.parametrize("flag, thinks", [
    ([], True),
    (["--chat-template-kwargs", '{"enable_thinking": false}'], False),
])
def test_generate_chat_passes_the_flag(cli_model, capsys, flag, thinks):
    assert kvlm.cli.commands.main(["generate", "--chat", "Hi", "--max-tokens", "1", "--json", *flag]) == 0
    prompt_ids = json.loads(capsys.readouterr().out)["prompt_token_ids"]
    assert prompt_text(cli_model, prompt_ids).endswith(NO_THINKING) != thinks


def test_chat_command_passes_the_flag(cli_model, monkeypatch):
    prompts = []
    stream = LLM.stream

    def recording_stream(self, prompt, params=None):
        prompts.append(prompt)
        return stream(self, prompt, params)

    monkeypatch.setattr(LLM, "stream", recording_stream)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAgain\n\n"))
    argv = ["chat", "--max-tokens", "1", "--chat-template-kwargs", '{"enable_thinking": false}']
    assert kvlm.cli.commands.main(argv) == 0
    assert len(prompts) == 2 and all(prompt_text(cli_model, p).endswith(NO_THINKING) for p in prompts)


@pytest.mark.parametrize("command", [["generate", "--chat", "Hi"], ["chat"]])
@pytest.mark.parametrize("value, words", [
    ('{"enable_thinking": fals', "not valid JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ('"yes"', "must be a JSON object, got str"),
    ('{"messages": []}', "cannot set messages"),
])
def test_bad_chat_template_kwargs_name_the_flag(command, value, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        kvlm.cli.commands.main([*command, "--chat-template-kwargs", value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "--chat-template-kwargs" in error and words in error


def test_chat_template_kwargs_with_a_plain_prompt_is_refused(capsys):
    assert kvlm.cli.commands.main(["generate", "--prompt", "x", "--chat-template-kwargs", '{"enable_thinking": false}']) == 1
    assert "--chat-template-kwargs applies to --chat only" in capsys.readouterr().err
