"""Weight-only int8/int4 matrices: what they reproduce, and a quantized SmolLM2 that still talks sense."""
from __future__ import annotations

import pytest
import torch

from kvlm.generate import GenerationSettings, generate
from kvlm.model.settings import resolve_settings
from kvlm.model.linear import Int4Linear, Int8Linear


def as_matrix(linear, n_in: int) -> torch.Tensor:
    """The weight a linear map applies, read back through its own kernel."""
    return linear(torch.eye(n_in, dtype=torch.bfloat16)).float().t()


def test_int4_groups_reproduce_q4_1_blocks(smollm2_gguf_path):
    from kvlm.loader.gguf_file import load_gguf

    _, weights, _ = load_gguf(smollm2_gguf_path)
    original = weights.layer(3, "ffn_up")  # stored as Q4_1 in the file
    restored = as_matrix(Int4Linear(original), original.shape[1])
    # Only bfloat16 rounding remains: of the block's scale and offset and of the output itself.
    rows, cols = original.shape
    block_size = original.view(rows, cols // 32, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    assert ((restored - original).abs() <= block_size * 2**-7).all()


def test_int8_rows_are_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(64, 96)
    restored = as_matrix(Int8Linear(weight), 96)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((restored - weight).abs() <= step * 0.5 + weight.abs() * 2**-7).all()  # + bf16 rounding


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="divisible by 32, got 40"):
        Int4Linear(torch.randn(8, 40))


def test_quant_needs_bfloat16():
    with pytest.raises(ValueError, match="quant 'int4' needs dtype bfloat16"):
        resolve_settings("float32", "int4")


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_smollm2_starts_like_float32(smollm2_gguf_path, smollm2, quant):
    from kvlm.load import load_model

    quantized = load_model(str(smollm2_gguf_path), "bfloat16", quant=quant)
    settings = GenerationSettings(max_tokens=4, ignore_eos=True)
    for prompt in ("The capital of France is", "def add(a, b):\n    return", "Water boils at"):
        ids = smollm2.tokenizer.encode(prompt)
        assert generate(quantized, ids, settings).token_ids[:2] == generate(smollm2, ids, settings).token_ids[:2]
