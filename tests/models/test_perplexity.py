"""llama-perplexity's method in kvlm: the chunking and BOS rules, the statistics, and the PPL itself against
transformers reading the same GGUF (float32), chunk by chunk over the same tokens."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from helpers.models import reference_logits
from kvlm.cli.commands import main
from kvlm.runtime.perplexity import (
    Accumulator, ChunkReport, ChunkScore, PerplexityError, PerplexityResult, iter_perplexity, perplexity, plan_chunks,
    score_chunk, tokenize, top1_agreement,
)

RELATIVE = 1e-4
N_CTX = 128

TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under a sheet of brown water. "
    "The farmers had seen it coming for days: the rain in the hills had not stopped since the start of the week, "
    "and every stream that fed the valley ran fast and loud. Still, nobody expected the old stone bridge to go. "
    "It had stood for more than two hundred years, through floods far worse than this one, and the children of "
    "the village crossed it every day on their way to school. When it fell, it fell quietly, one arch at a time, "
    "and the water carried the stones a short way downstream before it let them settle in the mud.\n\n"
    "In the weeks that followed, the village argued about what to build in its place. Some wanted a copy of the "
    "old bridge, stone for stone, so that nothing would change. Others said that a wider bridge of steel would "
    "let the trucks from the quarry pass, and that the money the quarry paid would keep the school open. The "
    "teacher, who had lived in the valley longer than anyone, listened to both sides and said very little. "
    "At the last meeting she stood up and reminded them that the bridge had never belonged to the people who "
    "built it, only to the people who crossed it, and that the children would cross whatever they chose.\n\n"
    "They chose stone in the end, though not the same stone. The new arches were lower and longer, so that the "
    "water could pass beneath them without climbing the banks, and the engineers set the foundations deep into "
    "the rock. It took two summers to finish. On the day it opened, the whole village walked across it together, "
    "slowly, as if they were testing it, and then the children ran back and forth until it was dark.\n\n"
    "Years later, visitors who came to see the valley were often told the story of the flood, and of the bridge "
    "that fell and the bridge that replaced it. The details changed a little with each telling. The water grew "
    "higher, the night grew longer, and the teacher's speech grew more eloquent than it had ever been. But the "
    "ending was always the same: the bridge was built for those who cross it, and the valley is still crossing."
)


# --- chunks, BOS and refusals, on token lists -------------------------------------------------------------------

def test_chunks_are_whole_n_ctx_slices_and_the_tail_is_dropped():
    tokens = list(range(10, 10 + 7 * N_CTX + 50))
    plan = plan_chunks(tokens, N_CTX)
    assert len(plan.chunks) == 7 and all(len(c) == N_CTX for c in plan.chunks)
    assert plan.chunks[3] == tokens[3 * N_CTX: 4 * N_CTX]
    assert plan.first == 64 and plan.scored_per_chunk == 63
    assert plan.targets[3] == tokens[3 * N_CTX + 65: 4 * N_CTX]
    assert len(plan_chunks(tokens, N_CTX, n_chunks=3).chunks) == 3
    assert len(plan_chunks(tokens, N_CTX, n_chunks=100).chunks) == 7  # at most the text's chunks


def test_odd_n_ctx_scores_from_n_ctx_floor_half():
    plan = plan_chunks(list(range(300)), 129)
    assert plan.first == 64 and plan.scored_per_chunk == 64 and len(plan.targets[0]) == 64


def test_bos_replaces_the_first_token_of_every_chunk_but_is_never_scored():
    tokens = [1] + list(range(100, 100 + 3 * 16 - 1))  # the text's own BOS at 0, as the tokenizer adds it
    plan = plan_chunks(tokens, 16, bos_id=1)
    assert [c[0] for c in plan.chunks] == [1, 1, 1]
    assert plan.chunks[1][1:] == tokens[17:32]
    assert plan.targets[1] == tokens[16 + 9: 32]  # the original tokens: position 0 is never a target
    assert plan_chunks(tokens, 16).chunks[1][0] == tokens[16]  # without BOS the tokens stay as they are


def test_text_shorter_than_two_contexts_is_refused_naming_count_and_limit():
    with pytest.raises(PerplexityError, match=r"only 255 tokens.*context of 128.*at least 2 x n_ctx = 256"):
        plan_chunks(list(range(255)), N_CTX)
    assert len(plan_chunks(list(range(256)), N_CTX).chunks) == 2


@pytest.mark.parametrize("n_ctx", [0, -512, 1, 2, 12.5, "512", True])
def test_invalid_n_ctx_is_refused(n_ctx):
    with pytest.raises(PerplexityError, match=rf"n_ctx must be an integer of at least 3.*got {re.escape(repr(n_ctx))}"):
        plan_chunks(list(range(1000)), n_ctx)


@pytest.mark.parametrize("n_chunks", [0, -1, 1.5])
def test_invalid_chunk_count_is_refused(n_chunks):
    with pytest.raises(PerplexityError, match=rf"number of chunks must be a positive integer.*got {n_chunks!r}"):
        plan_chunks(list(range(1000)), N_CTX, n_chunks)


class _Tokenizer:
    """A stand-in with the boundary tokens of the model under test."""

    def __init__(self, add_bos: bool, add_eos: bool) -> None:
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = 1, 2, add_bos, add_eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [100 + ord(c) for c in text]
        if add_special_tokens:
            ids = [1] * self.add_bos + ids + [2] * self.add_eos
        return ids


def test_tokenize_adds_bos_as_the_model_does_and_refuses_add_eos():
    assert tokenize(_Tokenizer(add_bos=True, add_eos=False), "ab") == ([1, 197, 198], 1)
    assert tokenize(_Tokenizer(add_bos=False, add_eos=False), "ab") == ([197, 198], None)
    with pytest.raises(PerplexityError, match="adds EOS"):
        tokenize(_Tokenizer(add_bos=True, add_eos=True), "ab")


# --- statistics -------------------------------------------------------------------------------------------------

def test_score_chunk_is_the_log_softmax_nll_and_the_argmax():
    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(0)) * 4
    targets = [3, 7, 11, 0, 49, 25, 8, 8, 1]  # one fewer than the rows: the last row predicts nothing scored
    score = score_chunk(logits, targets)
    expected = -torch.log_softmax(logits[:9].double(), -1)[torch.arange(9), targets]
    np.testing.assert_allclose(score.nll, expected.numpy(), rtol=1e-6)
    assert score.top1.tolist() == logits[:9].argmax(-1).tolist()


def test_final_ppl_and_its_standard_error_as_llama_cpp_computes_them():
    nll = np.array([2.0, 3.5, 1.25, 4.0, 0.5, 2.75])
    totals = Accumulator()
    running = [totals.add(ChunkScore(nll[:2], np.zeros(2))), totals.add(ChunkScore(nll[2:], np.zeros(4)))]
    plan = plan_chunks(list(range(12)), 6)  # 2 chunks scoring 2 tokens each: only the shapes matter here
    result = totals.result(plan, running)
    assert running == pytest.approx([math.exp(2.75), math.exp(nll.mean())])
    assert result.ppl == pytest.approx(math.exp(nll.mean()))
    # llama.cpp: ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1))
    assert result.ppl_stderr == pytest.approx(result.ppl * nll.std() / math.sqrt(len(nll) - 1))


# --- against transformers ---------------------------------------------------------------------------------------

def reference_ppl(hf_model, tokens: list[int], n_ctx: int, n_chunks: int, bos_id: int | None = None):
    """llama-perplexity's method written out plainly over transformers' logits: (ppl, per-token top-1)."""
    first, nll, top1 = n_ctx // 2, [], []
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx: (i + 1) * n_ctx]
        seen = [bos_id, *chunk[1:]] if bos_id is not None else chunk
        logits = reference_logits(hf_model, seen)[first: n_ctx - 1].double()
        targets = torch.tensor(chunk[first + 1:])
        nll += (-torch.log_softmax(logits, -1)[torch.arange(len(targets)), targets]).tolist()
        top1 += logits.argmax(-1).tolist()
    return math.exp(sum(nll) / len(nll)), np.array(top1)


@pytest.fixture(scope="module")
def smollm2_result(smollm2):
    return perplexity(smollm2, TEXT, n_ctx=N_CTX, n_chunks=3, kv_dtype="f32")


def test_smollm2_ppl_equals_transformers_on_the_same_chunks(smollm2, smollm2_result, hf_smollm2,
                                                          hf_smollm2_tokenizer):
    tokens = hf_smollm2_tokenizer(TEXT).input_ids  # SmolLM2 adds no BOS
    assert smollm2.tokenizer.encode(TEXT) == tokens
    expected, top1 = reference_ppl(hf_smollm2, tokens, N_CTX, 3)
    result = smollm2_result
    assert result.n_tokens == len(tokens) and result.n_chunks == 3 and result.n_scored == 3 * 63
    assert result.ppl == pytest.approx(expected, rel=RELATIVE)
    assert np.mean(result.top1 == top1) >= 0.99  # only a near-tie may flip
    assert result.targets.tolist() == [t for i in range(3) for t in tokens[i * N_CTX + 65: (i + 1) * N_CTX]]


def test_iterator_reports_the_running_ppl_after_each_chunk(smollm2, smollm2_result):
    items = list(iter_perplexity(smollm2, TEXT, n_ctx=N_CTX, n_chunks=2, kv_dtype="f32"))
    reports, result = items[:-1], items[-1]
    assert [type(r) for r in reports] == [ChunkReport] * 2 and isinstance(result, PerplexityResult)
    assert [r.index for r in reports] == [1, 2] and {r.n_chunks for r in reports} == {2}
    assert [r.running_ppl for r in reports] == result.running == smollm2_result.running[:2]
    assert result.running[-1] == result.ppl
    assert np.array_equal(result.top1, smollm2_result.top1[:126])
    assert top1_agreement(smollm2_result, smollm2_result) == 1.0
    with pytest.raises(ValueError, match="scored different tokens"):
        top1_agreement(result, smollm2_result)


def test_bos_model_chunks_start_with_bos_and_match_transformers(tmp_path):
    """A tiny random Llama whose tokenizer adds BOS: every chunk's first token becomes BOS, as in llama.cpp."""
    from helpers.gguf_factory import BOS_ID, gguf_metadata, gguf_tensors, llama_config, random_llama, write_gguf
    from kvlm.loader.load import load_model

    reference = random_llama(llama_config(n_layer=2))
    path = write_gguf(tmp_path / "bos.gguf", {**gguf_metadata(reference.config), "tokenizer.ggml.add_bos_token": True},
                      gguf_tensors(reference))
    model = load_model(str(path), "float32", quant=None)
    tokens, bos_id = tokenize(model.tokenizer, TEXT)
    assert bos_id == BOS_ID and tokens[0] == BOS_ID and tokens[1:] == model.tokenizer.encode(TEXT, False)
    n_ctx = 32
    result = perplexity(model, TEXT, n_ctx=n_ctx, n_chunks=4, kv_dtype="f32")
    expected, top1 = reference_ppl(reference, tokens, n_ctx, 4, bos_id=BOS_ID)
    assert result.ppl == pytest.approx(expected, rel=RELATIVE)
    without_bos, _ = reference_ppl(reference, tokens, n_ctx, 4)
    assert not result.ppl == pytest.approx(without_bos, rel=RELATIVE)  # the rule matters for this model


# --- the command ------------------------------------------------------------------------------------------------

@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture
def loads(monkeypatch, smollm2):
    """The command's load_model, answered with the already loaded float32 SmolLM2; the calls it got."""
    import kvlm.cli.commands

    calls = []

    def load_model(spec, dtype, **settings):
        calls.append((spec, dtype, settings))
        return smollm2

    monkeypatch.setattr(kvlm.cli.commands, "load_model", load_model)
    return calls


def test_cli_prints_running_ppl_and_final_estimate(loads, smollm2_result, text_file, capsys):
    args = ["perplexity", str(text_file), "--model", "some.gguf", "--ctx", str(N_CTX), "--chunks", "3",
            "--dtype", "float32", "--kv-dtype", "f32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    running = "".join(f"[{i}]{p:.4f}," for i, p in enumerate(smollm2_result.running, start=1))
    final = f"Final estimate: PPL = {smollm2_result.ppl:.4f} +/- {smollm2_result.ppl_stderr:.5f}"
    assert out == f"{running}\n{final}\n"
    assert loads[0][:2] == ("some.gguf", "float32")

    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ppl"] == pytest.approx(smollm2_result.ppl, rel=1e-12)
    assert (report["n_ctx"], report["n_chunks"], report["n_scored"]) == (N_CTX, 3, 189)
    assert report["running_ppl"] == pytest.approx(smollm2_result.running, rel=1e-12)


def test_cli_n_ctx_is_also_n_ctx(loads, smollm2_result, text_file, capsys):
    assert main(["perplexity", str(text_file), "--n-ctx", str(N_CTX), "--chunks", "1", "--kv-dtype", "f32"]) == 0
    assert capsys.readouterr().out.startswith(f"[1]{smollm2_result.running[0]:.4f},\n")


def test_cli_refuses_a_short_text_and_a_bad_ctx(loads, text_file, tmp_path, capsys):
    assert main(["perplexity", str(text_file), "--ctx", "1024"]) == 1
    assert re.search(r"only \d+ tokens; perplexity with a context of 1024 needs at least 2 x n_ctx = 2048",
                     capsys.readouterr().err)
    assert main(["perplexity", str(text_file), "--ctx", "0"]) == 1
    assert "n_ctx must be an integer of at least 3 (a chunk scores its last n_ctx - n_ctx/2 - 1 tokens), got 0" \
        in capsys.readouterr().err
    assert main(["perplexity", str(tmp_path / "missing.txt")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert len(loads) == 1  # a bad --ctx or a missing file is refused before the model loads
