"""The GPU backend (KVLM_BACKEND=triton: kvlm.kernels.gpu's Triton kernels for attention over cells, norms and RoPE)
running whole models and the engine, against torch's backend on the same weights: random-weight float32 models of
each memory kind (unified: Llama; iSWA: Gemma 3, window 8; hybrid: LFM2; recurrent: Mamba2), the prompt's and each
decode step's logits within a GPU's tolerance, greedy continuations through LLM.generate (several requests batched,
a shared prefix from the prefix cache) equal. On a GPU where there is one; else through Triton's interpreter
(tests/conftest.py) on the CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.kind_files import KIND_FILES  # noqa: E402
from helpers.models import prefill_then_decode_logits, token_ids  # noqa: E402
from kvlm import LLM, SamplingParams  # noqa: E402
from kvlm.core.family import ATTENTION  # noqa: E402
from kvlm.loader.load import load_model  # noqa: E402
from kvlm.model.triton_backend import TritonBackend  # noqa: E402



DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", params=sorted(KIND_FILES))
def models(request, tmp_path_factory):
    """(torch's backend on the CPU, the Triton backend) over one file, float32 dense; the Triton one on the GPU
    where there is one (weights, K/V cells and states in its memory), else on the CPU through the interpreter."""
    path = str(KIND_FILES[request.param](tmp_path_factory.mktemp(request.param)))
    on_torch = load_model(path, "float32", quant=None, progress=False, device="cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVLM_BACKEND", "triton")
        on_triton = load_model(path, "float32", quant=None, progress=False, device=DEVICE)
    assert isinstance(on_triton.decoder.ops, TritonBackend) and on_triton.decoder.device == DEVICE
    return on_torch, on_triton


def test_prompt_and_decode_logits_match_torch(models):
    on_torch, on_triton = models
    ids = [1, *token_ids(on_torch.config.vocab_size - 3, 19, seed=2)]
    want = prefill_then_decode_logits(on_torch, ids, 14)
    got = prefill_then_decode_logits(on_triton, ids, 14)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)  # a GPU's tf32 products


def test_generate_batched_with_a_shared_prefix_matches_torch(models):
    """A request, then three batched in the same engine, two sharing its 20-token prefix (reused from the prefix
    cache where the memory kind keeps it: full attention only, a window's cells being dropped as it slides)."""
    on_torch, _ = models
    prefix = [1, *token_ids(on_torch.config.vocab_size - 3, 19, seed=5)]
    prompts = [prefix + [7, 8, 9], prefix + [10, 11], [1, 20, 21, 22, 23]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for backend, model in zip(("torch", "triton"), models):
        llm = LLM(model, n_ctx=64, max_num_seqs=4)
        results = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
        outputs[backend] = [o.token_ids for o in results]
        cached = [o.n_cached_tokens for o in results]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(tokens) == 4 for tokens in outputs["triton"])
    assert outputs["triton"][0] == outputs["triton"][1]
    if set(on_torch.config.layer_kinds) == {ATTENTION}:
        assert min(cached[1:3]) >= 16, cached  # (whole blocks of 16)
