"""The server folder's shared fixtures. `client`: an `openai` client of a live server over the module's own `model`
fixture; `script`: that model's output scripted (every step's logits favour the next token of what
helpers.chat.write put in it); `reference_tokenizer`: transformers' renderer over Gemma 4's chat vocabulary, for
test_gemma4_chat and test_gemma4_tool_calls (test_qwen35_chat and test_gpt_oss_chat have their own)."""
from __future__ import annotations

import openai
import pytest
import torch

from helpers.chat import MODEL, N_CTX
from helpers.gemma4_chat import BOS, BYTE_LEVEL_SIZE, CHAT_TOKENS, EOS
from helpers.gguf_factory import byte_level_tokenizer
from helpers.server import serving
from kvlm.engine.engine import Engine
from kvlm.sampling.sampler import RequestSampler
from kvlm.server.app import create_app


@pytest.fixture(scope="module")
def reference_tokenizer():
    """transformers' renderer, over the vocabulary kvlm's tokenizer has: `<bos>` its bos_token."""
    hf_tokenizer = byte_level_tokenizer(BYTE_LEVEL_SIZE)
    hf_tokenizer.add_special_tokens({"bos_token": BOS, "eos_token": EOS})
    hf_tokenizer.add_tokens(list(CHAT_TOKENS))
    return hf_tokenizer


@pytest.fixture(scope="module")
def client(model, one_thread):
    with serving(create_app(Engine(model, n_ctx=N_CTX, max_num_seqs=1), MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture
def script(monkeypatch, model) -> dict:
    """Every request writes state["text"]: each step's logits favour its next token (through the request's real
    sampler); state["prompts"] records each request's prompt ids."""
    state = {"ids": [], "prompts": []}
    init, sample = RequestSampler.__init__, RequestSampler.sample

    def recording_init(self, params, prompt_token_ids):
        init(self, params, prompt_token_ids)
        state["prompts"].append(list(prompt_token_ids))
        self.scripted = 0

    def scripted_sample(self, logits, allowed=None):
        favoured = torch.full_like(logits, -30.0)
        favoured[state["ids"][self.scripted]] = 30.0
        self.scripted += 1
        return sample(self, favoured, allowed)

    monkeypatch.setattr(RequestSampler, "__init__", recording_init)
    monkeypatch.setattr(RequestSampler, "sample", scripted_sample)
    return state
