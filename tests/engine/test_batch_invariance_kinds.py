"""One answer per greedy request on random-weight models (transformers builds them) of every memory kind, mixtures
of experts and weight type, in kvlm's default mode: every prompt token's logits are the same bits in every layout of
test_batch_invariance.py (micro-batches of 1, 7 and 64, a cached prefix, beside other sequences, runs of guesses,
one token per step), for every KV cache dtype.

unified: Llama (Q4_0 file), Qwen3 (F32 file: dense products); iSWA: Gemma 3 (F32, window 8, crossed many times),
Gemma 4 (Q8_0: two row sizes, shared K/V, per-layer inputs); hybrid: LFM2 (short convolutions), Qwen3.5 (the gated
delta rule, an output gate); recurrent: Mamba2; experts: Qwen2-MoE (Q8_0, a sigmoid-gated shared expert), gpt-oss
(MXFP4 experts, sinks, sliding layers). Each with kvlm's native kernels and with torch's ops alone, as where no
compiler builds them.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from helpers.batch_invariance import KV_DTYPES, assert_every_layout_equal
from helpers.family_factory import SPECS, family_gguf_metadata, family_gguf_tensors, random_model
from helpers.gemma3_factory import gguf_of as gemma3_gguf, random_gemma3
from helpers.gemma4_factory import random_gemma4, write_gemma4_gguf
from helpers.gguf_factory import write_gguf
from helpers.gptoss_factory import random_gpt_oss, write_gpt_oss_gguf
from helpers.models import load_on
from helpers.moe_factory import SPECS as MOE_SPECS, random_moe, save_moe_folder, write_moe_gguf
from helpers.qwen35_factory import random_qwen35, write_qwen35_gguf
from helpers.recurrent_factory import lfm2_gguf, mamba2_gguf, random_lfm2, random_mamba2

pytestmark = pytest.mark.usefixtures("one_thread")


def _family(name: str, quant: T):
    spec = SPECS[name]
    model = random_model(spec)
    return lambda folder: write_gguf(folder / "model.gguf", family_gguf_metadata(model, spec),
                                     family_gguf_tensors(model, spec), arch=spec.arch, quant=quant)


def _qwen2moe(folder):
    spec = MOE_SPECS["qwen2moe"]
    model = random_moe(spec)
    return write_moe_gguf(model, spec, save_moe_folder(model, folder / "hf"), folder / "model.gguf", T.Q8_0)


FILES = {  # name: (how its file is written, the memory kind, whether it holds attention rows)
    "llama-q4_0": (lambda folder: _family("llama-llama3", T.Q4_0)(folder), True),
    "qwen3-f32": (lambda folder: _family("qwen3", T.F32)(folder), True),
    "smollm3-q4_0": (lambda folder: _family("smollm3", T.Q4_0)(folder), True),  # a layer without RoPE
    "phi3-q8_0": (lambda folder: _family("phi3-longrope", T.Q8_0)(folder), True),  # Q/K/V, gate/up read from one
    "gemma3-f32": (lambda folder: gemma3_gguf(random_gemma3(), folder), True),
    "gemma4-q8_0": (lambda folder: write_gemma4_gguf(random_gemma4(), folder / "model.gguf", T.Q8_0), True),
    "lfm2-q8_0": (lambda folder: lfm2_gguf(random_lfm2(), folder, T.Q8_0), True),
    "qwen35-q8_0": (lambda folder: write_qwen35_gguf(random_qwen35(num_hidden_layers=4), folder / "model.gguf",
                                                     T.Q8_0), True),
    "mamba2-q8_0": (lambda folder: mamba2_gguf(random_mamba2(), folder, T.Q8_0), False),
    "qwen2moe-q8_0": (_qwen2moe, True),
    "gptoss-mxfp4": (lambda folder: write_gpt_oss_gguf(random_gpt_oss(), folder / "model.gguf", T.MXFP4), True),
}


@pytest.fixture(scope="module", params=[(name, ops) for name in sorted(FILES) for ops in ("native", "torch")],
                ids="-".join)
def model(request, tmp_path_factory):
    """Each file loaded with kvlm's native kernels, and with torch's ops alone (a machine without a compiler)."""
    name, ops = request.param
    write, _ = FILES[name]
    return name, load_on(write(tmp_path_factory.mktemp(name)), ops == "native")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_layout_gives_the_same_logits(model, kv_dtype):
    name, loaded = model
    if not FILES[name][1] and kv_dtype != "f32":
        pytest.skip("a recurrent model holds no K/V rows: its cache dtype means nothing")
    if kv_dtype == "q8_0" and loaded.config.head_dim % 32:
        pytest.skip(f"a q8_0 cache needs heads of whole 32-value blocks, not {loaded.config.head_dim}")
    generator = np.random.default_rng(7)
    vocab = loaded.config.vocab_size
    prompt = [1, *generator.integers(3, vocab, 69).tolist()]
    other = [1, *generator.integers(3, vocab, 17).tolist()]
    assert_every_layout_equal(loaded, kv_dtype, prompt, other)
