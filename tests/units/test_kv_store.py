"""The K/V store: byte formula, layout, q8_0 blocks, dtype names."""
from __future__ import annotations

import pytest
import torch

from kvlm import Context
from kvlm.core.errors import CacheError
from kvlm.core.config import ModelConfig
from kvlm.memory.kv_store import KVStore, kv_bytes_for

SMALL = ModelConfig(
    architecture="llama", name="small", n_layer=3, n_embd=32, n_ff=64, n_head=4, n_head_kv=2, head_dim=8,
    vocab_size=50, n_ctx_train=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
)


@pytest.mark.parametrize("dtype, element", [("f32", 4), ("f16", 2), ("bf16", 2)])
def test_kv_bytes_follow_the_formula_and_the_allocation(dtype, element):
    store = KVStore(SMALL, 40, dtype)
    expected = 2 * SMALL.n_layer * 40 * SMALL.n_head_kv * SMALL.head_dim * element
    assert store.kv_bytes == expected == kv_bytes_for(SMALL, 40, dtype)
    k, v = store.k.data, store.v.data
    assert store.kv_bytes == k.numel() * k.element_size() + v.numel() * v.element_size()
    assert k.shape == (SMALL.n_layer, 40, SMALL.n_head_kv, SMALL.head_dim)  # layer-major
    assert k.data_ptr() != v.data_ptr()


def test_q8_0_bytes_are_34_per_block_of_32():
    config = ModelConfig(**{**SMALL.__dict__, "head_dim": 32})
    store = KVStore(config, 40, "q8_0")
    assert store.kv_bytes == 2 * config.n_layer * 40 * config.n_head_kv * 34 == kv_bytes_for(config, 40, "q8_0")


def test_q8_0_rows_read_back_within_one_quantization_step():
    config = ModelConfig(**{**SMALL.__dict__, "head_dim": 64})
    store = KVStore(config, 8, "q8_0")
    torch.manual_seed(0)
    k, v = torch.randn(3, config.n_head_kv, 64), torch.randn(3, config.n_head_kv, 64)
    store.write(1, torch.tensor([5, 0, 2]), k, v)
    keys, values = store.read(1, 6)
    step = k.unflatten(-1, (2, 32)).abs().amax(-1).repeat_interleave(32, -1) / 127
    assert ((keys[[5, 0, 2]] - k).abs() <= step * 0.5 + 1e-3 * k.abs()).all()


def test_smollm2_kv_bytes(smollm2):
    assert Context(smollm2, n_ctx=8192, n_batch=512).memory.kv_bytes == 2 * 30 * 8192 * 3 * 64 * 4


def test_unknown_kv_dtype_is_named():
    with pytest.raises(CacheError, match="'q3'"):
        KVStore(SMALL, 4, "q3")
