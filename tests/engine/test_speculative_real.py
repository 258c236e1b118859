"""Speculative decoding on the real models (SmolLM2, Qwen2.5-Coder-0.5B, Gemma 3 270M, as fetched from PyPI, on
kvlm's defaults; the batch-invariant mode where the native kernels are not built): greedy output unchanged with prompt lookup, a model drafting for itself accepts every guess, a draft
of another vocabulary is refused naming the token; the CLI flag, the server's counters."""
from __future__ import annotations

import json

import httpx
import pytest

import kvlm.cli.commands
import kvlm.engine.llm
from kvlm import LLM, SamplingParams, load_model
from kvlm.engine.engine import Engine
from kvlm.server.app import create_app
from kvlm.speculative.vocab import IncompatibleDraftError
from helpers.server import serving
from helpers.speculative import exact_model

pytestmark = pytest.mark.usefixtures("one_thread")

EDIT = ("Rename the function total to sum_prices and output the whole code:\n\n"
        "def total(items):\n    result = 0.0\n    for item in items:\n        result += item.price * item.quantity\n"
        "    return result\n\n\ndef cheapest(items):\n    best = None\n    for item in items:\n"
        "        if best is None or item.price < best.price:\n            best = item\n    return best\n")
NGRAM = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "adaptive": False}


@pytest.fixture(scope="module", params=["smollm2", "qwen", "gemma"])
def real_model(request, smollm2_gguf_path, qwen_gguf_path, gemma_gguf_path):
    path = {"smollm2": smollm2_gguf_path, "qwen": qwen_gguf_path, "gemma": gemma_gguf_path}[request.param]
    return exact_model(path, default=True)


def _chat_ids(model) -> list[int]:
    return model.tokenizer.encode_chat([{"role": "user", "content": EDIT}])


def test_greedy_output_is_unchanged_on_real_models(real_model):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompt = _chat_ids(real_model)
    expected = LLM(real_model, n_ctx=1024, max_num_seqs=2).generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(real_model, n_ctx=1024, max_num_seqs=2, speculative_config=NGRAM)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert output.token_ids == expected.token_ids
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 0  # the answer repeats the code: prompt lookup finds it
    assert output.timings["mean_acceptance_length"] == pytest.approx(stats.mean_acceptance_length)


def test_qwen_drafting_for_itself_accepts_every_guess(qwen_gguf_path):
    model = exact_model(qwen_gguf_path, default=True)
    llm = LLM(model, n_ctx=1024, max_num_seqs=2,
              speculative_config={"model": model, "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(max_tokens=24, temperature=0.0)
    output = llm.generate([_chat_ids(model)], params, use_tqdm=False)[0]
    assert output.token_ids == LLM(model, n_ctx=1024).generate([_chat_ids(model)], params, use_tqdm=False)[0].token_ids
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_a_draft_of_another_vocabulary_is_refused_naming_the_token(smollm2_gguf_path, qwen_gguf_path):
    qwen = load_model(str(qwen_gguf_path), progress=False)
    with pytest.raises(IncompatibleDraftError, match=r"the draft's bos_id is 1, the target's 151643"):
        Engine(qwen, n_ctx=256, speculative_config={"model": str(smollm2_gguf_path), "num_speculative_tokens": 2})


def test_a_differing_token_is_named(qwen_gguf_path, monkeypatch):
    qwen = load_model(str(qwen_gguf_path), progress=False)
    draft = load_model(str(qwen_gguf_path), progress=False)
    original = draft.tokenizer.token_text
    monkeypatch.setattr(draft.tokenizer, "token_text", lambda i: "Ġx" if i == 1000 else original(i))
    with pytest.raises(IncompatibleDraftError, match=r"token 1000 is 'Ġx' in the draft's vocabulary and '.+' in the"):
        Engine(qwen, n_ctx=256, speculative_config={"model": draft, "num_speculative_tokens": 2})


def test_cli_generate_takes_the_flag_and_reports_acceptance(smollm2_gguf_path, monkeypatch, capsys):
    model = exact_model(smollm2_gguf_path, default=True)
    monkeypatch.setattr(kvlm.cli.commands, "load_model", lambda *args, **kwargs: model)
    base = ["generate", "--chat", EDIT, "--max-tokens", "64", "--temperature", "0", "--json"]
    assert kvlm.cli.commands.main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert kvlm.cli.commands.main([*base, "--speculative-config", json.dumps(NGRAM)]) == 0
    speculated = json.loads(capsys.readouterr().out)
    assert speculated["token_ids"] == plain["token_ids"]
    assert speculated["timings"]["mean_acceptance_length"] > 1.0 and "mean_acceptance_length" not in plain["timings"]


def test_cli_refuses_a_bad_config_naming_it(capsys):
    with pytest.raises(SystemExit):
        kvlm.cli.commands.main(["generate", "--prompt", "x", "--speculative-config", '{"method": "ngram"}'])
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_server_counts_guesses_in_prometheus(smollm2_gguf_path):
    model = exact_model(smollm2_gguf_path, default=True)
    engine = Engine(model, n_ctx=1024, max_num_seqs=2, speculative_config=NGRAM)
    with serving(create_app(engine, "smollm2", None)) as url:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": EDIT}], "max_tokens": 64,
                "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("kvlm_spec_decode") and not line.startswith("#")}
    stats = engine.speculator.stats
    assert values["kvlm_spec_decode_num_drafts_total"] == stats.num_drafts > 0
    assert values["kvlm_spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert values["kvlm_spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens > 0
    assert values['kvlm_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == stats.accepted_per_pos[0]
