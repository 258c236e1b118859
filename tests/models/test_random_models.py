"""kvlm against transformers on small random-weight Llama models, one per attention head layout.

The models are made by transformers itself and read by kvlm from a Hugging Face folder and from GGUF
files written as llama.cpp writes them; no hub weights are involved. Together with the op-level test of
grouped_attention, this checks the Q/K un-permutation and the GQA grouping independently of SmolLM2.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType

from helpers.gguf_factory import llama_config, random_llama, save_hf_folder, write_model_gguf
from helpers.models import full_sequence_logits, max_diff, prefill_then_decode_logits, reference_logits, token_ids
from kvlm.runtime.generate import GenerationSettings, generate
from kvlm.loader.load import load_model
from kvlm.kernels import BlockMatrix, dequantize
from kvlm.loader.gguf_file import open_gguf_model
from kvlm.loader.hf_folder import open_hf_folder
from kvlm.model.ops import grouped_attention

TOLERANCE = 1e-4
N_PROMPT, N_DECODE, N_GREEDY = 10, 8, 16

LAYOUTS = {
    "mha": dict(n_head=4, n_head_kv=4),
    "gqa": dict(hidden_size=128, n_head=8, n_head_kv=2, n_layer=3, rope_theta=500000.0, rms_norm_eps=1e-6),
    "mqa": dict(n_head=4, n_head_kv=1, rope_theta=1000.0),
    "untied": dict(n_head=4, n_head_kv=2, tie_word_embeddings=False),
    "wide_heads": dict(n_head=4, n_head_kv=2, head_dim=32),  # head_dim != hidden_size / n_head
}
QUANTS = (GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(layout):
    return random_llama(llama_config(**LAYOUTS[layout]), seed=len(layout))


@pytest.fixture(scope="module")
def hf_folder(reference, layout, tmp_path_factory):
    return save_hf_folder(reference, tmp_path_factory.mktemp(f"hf-{layout}"))


@pytest.fixture(scope="module")
def ours_from_folder(hf_folder):
    return load_model(str(hf_folder), "float32")


def assert_logits_match(ours, hf_model) -> None:
    """Full-sequence prefill, and prefill + cached decode steps, against one transformers forward.

    Row i of transformers' causal forward over the whole sequence is the last-position logits of
    its first i+1 tokens, so each decode step is compared to that row.
    """
    ids = token_ids(ours.config.vocab_size, N_PROMPT + N_DECODE)
    expected = reference_logits(hf_model, ids)
    assert max_diff(full_sequence_logits(ours, ids), expected) <= TOLERANCE
    assert max_diff(prefill_then_decode_logits(ours, ids, N_PROMPT), expected[N_PROMPT - 1 :]) <= TOLERANCE


def assert_greedy_matches(ours, hf_model) -> None:
    # EOS is switched off on both sides: a random model may well pick it, and this compares the argmaxes.
    prompt = token_ids(ours.config.vocab_size, 8, seed=1)
    hf_settings = transformers.GenerationConfig(
        max_new_tokens=N_GREEDY, do_sample=False, eos_token_id=None, pad_token_id=None
    )
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), generation_config=hf_settings)[0, len(prompt) :]
    settings = GenerationSettings(max_tokens=N_GREEDY, ignore_eos=True)
    assert generate(ours, prompt, settings).token_ids == expected.tolist()


def test_config_read_from_folder(ours_from_folder, reference):
    hf, ours = reference.config, ours_from_folder.config
    assert (ours.n_head, ours.n_head_kv, ours.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rope.theta == hf.rope_parameters["rope_theta"]


def test_hf_folder_logits_match_transformers(ours_from_folder, reference):
    assert_logits_match(ours_from_folder, reference)


def test_hf_folder_greedy_equals_transformers_generate(ours_from_folder, reference):
    assert_greedy_matches(ours_from_folder, reference)


@pytest.fixture(scope="module", params=QUANTS, ids=lambda q: q.name)
def quant(request) -> GGMLQuantizationType:
    return request.param


@pytest.fixture(scope="module")
def gguf_path(reference, layout, quant, tmp_path_factory):
    # One file per folder, so transformers finds nothing but the GGUF there.
    folder = tmp_path_factory.mktemp(f"gguf-{layout}-{quant.name}")
    return write_model_gguf(reference, folder / "model.gguf", quant)


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_path):
    """transformers' own reading of the GGUF: its un-permutation and dequantization, not kvlm's."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


def test_gguf_logits_match_transformers_reading_the_same_file(gguf_path, hf_from_gguf):
    assert_logits_match(load_model(str(gguf_path), "float32"), hf_from_gguf)


def test_gguf_greedy_equals_transformers_generate(gguf_path, hf_from_gguf):
    assert_greedy_matches(load_model(str(gguf_path), "float32"), hf_from_gguf)


def test_gguf_weights_are_the_folder_weights(gguf_path, quant, hf_folder):
    """Exactly equal from an F32 file, so the un-permutation is the exact inverse of llama.cpp's."""
    config, weights, _ = open_gguf_model(gguf_path)
    folder_config, folder_weights = open_hf_folder(hf_folder)
    # GGUF stores the epsilon as float32, as llama.cpp does; the name comes from each source.
    assert config.rms_norm_eps == pytest.approx(folder_config.rms_norm_eps, rel=1e-6)
    assert replace(config, name="", rms_norm_eps=0.0) == replace(folder_config, name="", rms_norm_eps=0.0)
    assert weights.names() == folder_weights.names()
    for name in weights.names():
        stored = weights.read(name)
        tensor = dequantize(stored) if isinstance(stored, BlockMatrix) else stored.float()
        expected = folder_weights.read(name).float()
        # Q8_0 rounds each block of 32 to 1/127 of its largest value, so half of that at most.
        tolerance = 0.0 if quant == GGMLQuantizationType.F32 else expected.abs().max().item() / 200
        assert max_diff(tensor, expected) <= tolerance, name


def test_gguf_and_folder_tokenizers_agree(gguf_path, ours_from_folder):
    text = "Hello world, this is a tiny random model"
    assert load_model(str(gguf_path), "float32").tokenizer.encode(text) == ours_from_folder.tokenizer.encode(text)


# grouped_attention at the op level

HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
N_QUERIES, N_ROWS, HEAD_DIM = 5, 9, 8


@pytest.fixture(params=list(HEAD_LAYOUTS))
def heads(request) -> tuple[int, int]:
    return HEAD_LAYOUTS[request.param]


def causal_mask(n_tokens: int, n_past: int) -> torch.Tensor:
    """Additive mask letting token i (at row n_past + i) see rows 0 .. n_past + i."""
    rows = torch.arange(n_tokens)[:, None] + n_past
    cols = torch.arange(n_past + n_tokens)[None, :]
    return torch.zeros(rows.shape[0], cols.shape[1]).masked_fill_(cols > rows, float("-inf"))


@pytest.fixture(params=["causal", "no_mask"])
def mask(request) -> torch.Tensor | None:
    return causal_mask(N_QUERIES, N_ROWS - N_QUERIES) if request.param == "causal" else None


def naive_attention(q, k, v, mask) -> torch.Tensor:
    """One query head at a time over its own copy of K and V."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    heads = []
    for h in range(q.shape[1]):
        scores = q[:, h] @ k[:, h].T / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores + mask
        heads.append(torch.softmax(scores, dim=-1) @ v[:, h])
    return torch.cat(heads, dim=-1)


def forbid_kv_copies(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("grouped_attention copied K/V per query head")

    for owner in (torch, torch.Tensor):
        monkeypatch.setattr(owner, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat", refuse)
    monkeypatch.setattr(torch.Tensor, "expand", refuse)


def test_each_query_head_reads_its_groups_kv_head(heads, mask, monkeypatch):
    n_head, n_kv = heads
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(N_QUERIES, n_head, HEAD_DIM, generator=generator)
    k = torch.randn(N_ROWS, n_kv, HEAD_DIM, generator=generator)
    # V of KV head j is j + 1 everywhere, so whatever the weights, query head h must output its head's value.
    v = torch.ones(N_ROWS, n_kv, HEAD_DIM) * (torch.arange(n_kv) + 1.0)[None, :, None]
    forbid_kv_copies(monkeypatch)
    out = grouped_attention(q, k, v, mask).view(N_QUERIES, n_head, HEAD_DIM)
    kv_head_of = torch.arange(n_head) // (n_head // n_kv)
    assert torch.allclose(out, (kv_head_of + 1.0)[None, :, None].expand_as(out), atol=1e-6)


def test_grouped_attention_equals_per_head_reference(heads, mask, monkeypatch):
    n_head, n_kv = heads
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(N_QUERIES, n_head, HEAD_DIM, generator=generator)
    k, v = torch.randn(2, N_ROWS, n_kv, HEAD_DIM, generator=generator)
    expected = naive_attention(q, k, v, mask)
    forbid_kv_copies(monkeypatch)
    assert torch.allclose(grouped_attention(q, k, v, mask), expected, atol=1e-6)
