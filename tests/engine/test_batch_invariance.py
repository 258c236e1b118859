"""One answer per greedy request: in kvlm's default mode a token's logits are the same bits however it reaches the
cache, on the real SmolLM2, Qwen2.5-Coder-0.5B and Gemma 3 270M, for every KV cache dtype.

The layouts: the prompt whole in one micro-batch (the reference); cut into micro-batches of 1, 7 and 64 tokens; its
first half computed earlier by another sequence and shared with it (what the prefix cache does); beside another
sequence's prompt in the same batch, with a third sequence in the cache; in runs of 5 tokens each with its logits
beside another sequence's decode token (a last token and its guesses being verified); one token per step beside
another sequence's decode token. Every token's logits must be equal, exactly: by construction, every token attends
per token over its own cells in position order through the same native kernel, every product gives a row the same
bits at any row count, and every elementwise op computes an element from its row alone (see docs/ARCHITECTURE.md,
"Batch invariance"). The same on torch's ops alone (no compiler), where attention and transcendental functions run in
float64 and round once. The random-weight models of every memory kind, MoE and weight type are in
test_batch_invariance_kinds.py; the engine and the server in test_batch_invariance_engine.py.
"""
from __future__ import annotations

import pytest

from helpers.batch_invariance import KV_DTYPES, assert_every_layout_equal
from helpers.models import load_on

TEXT = ("The capital of France is a city that has long been known for its art, its food and its river. Every year "
        "millions of visitors walk along the banks of the Seine, climb the tower built for the fair of 1889, and "
        "queue for hours to see a small painting of a woman who smiles at no one in particular. Meanwhile")
OTHER = "def square(x):\n    return x * x\n\nprint(square(3))"


@pytest.fixture(scope="module")
def default_smollm2(smollm2_gguf_path):
    return load_on(smollm2_gguf_path, native=True)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_smollm2_every_layout_gives_the_same_logits(default_smollm2, kv_dtype):
    tokenizer = default_smollm2.tokenizer
    assert_every_layout_equal(default_smollm2, kv_dtype, tokenizer.encode(TEXT), tokenizer.encode(OTHER))


def test_smollm2_in_bfloat16_every_layout_gives_the_same_logits(smollm2_gguf_path):
    """bfloat16 activations: the default on CPUs with native bf16 (AVX-512 BF16, AMX), checked here on any CPU."""
    model = load_on(smollm2_gguf_path, True, "bfloat16")
    tokenizer = model.tokenizer
    assert_every_layout_equal(model, "bf16", tokenizer.encode(TEXT), tokenizer.encode(OTHER))


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_qwen25_every_layout_gives_the_same_logits(qwen_gguf_path, kv_dtype):
    model = load_on(qwen_gguf_path, True)  # Q4_K, Q5_0, Q6_K and Q8_0 matrices
    assert_every_layout_equal(model, kv_dtype, model.tokenizer.encode(TEXT), model.tokenizer.encode(OTHER))


@pytest.mark.parametrize("kv_dtype", ["f16", "bf16"])
def test_gemma3_every_layout_gives_the_same_logits(gemma_gguf_path, kv_dtype):
    model = load_on(gemma_gguf_path, True)  # iSWA; Q4_K, Q6_K and Q8_0 matrices; GeGLU, softcap-free
    assert_every_layout_equal(model, kv_dtype, model.tokenizer.encode(TEXT), model.tokenizer.encode(OTHER))


@pytest.mark.parametrize("name", ["smollm2", "qwen", "gemma"])
def test_on_torch_ops_alone_every_layout_gives_the_same_logits(name, smollm2_gguf_path, qwen_gguf_path,
                                                                gemma_gguf_path):
    """Where no compiler builds kvlm's kernels: matrices dequantized, products, attention and activations in torch."""
    path = {"smollm2": smollm2_gguf_path, "qwen": qwen_gguf_path, "gemma": gemma_gguf_path}[name]
    model = load_on(path, native=False)
    assert_every_layout_equal(model, "f16", model.tokenizer.encode(TEXT), model.tokenizer.encode(OTHER))
