"""The single-sequence KV cache: byte formula, checked indexing, commit discipline, reset."""
from __future__ import annotations

import pytest
import torch

from kvlm.errors import CacheError
from kvlm.generate import decode, prefill
from kvlm.loader.config import ModelConfig
from kvlm.memory.kv_store import KVStore, kv_bytes_for
from kvlm.memory.sequence_cache import SequenceCache

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
    cache = SequenceCache(smollm2.config, 8192)
    assert cache.kv_bytes == 2 * 30 * 8192 * 3 * 64 * 4


def test_unknown_kv_dtype_is_named():
    with pytest.raises(CacheError, match="'q3'"):
        KVStore(SMALL, 4, "q3")


def test_write_past_max_context_raises_before_writing(smollm2):
    cache = SequenceCache(smollm2.config, 6)
    prefill(smollm2.decoder, cache, [1, 2, 3, 4, 5])
    snapshot = cache.store.k.data.clone(), cache.store.v.data.clone()
    with pytest.raises(CacheError, match="max_context is 6"):
        prefill(smollm2.decoder, cache, [6, 7])
    assert cache.length == 5
    assert torch.equal(cache.store.k.data, snapshot[0]) and torch.equal(cache.store.v.data, snapshot[1])
    decode(smollm2.decoder, cache, 6)
    with pytest.raises(CacheError, match="position 6"):
        decode(smollm2.decoder, cache, 7)
    assert cache.length == 6


def test_decode_at_a_position_other_than_the_length_is_refused(smollm2):
    cache = SequenceCache(smollm2.config, 8)
    prefill(smollm2.decoder, cache, [1, 2, 3])
    with pytest.raises(CacheError, match="kv_pos 5"):
        cache.decode_view(torch.tensor([5]))


class _FailingLayer(Exception):
    pass


def test_failure_in_a_middle_layer_leaves_the_length_unchanged(smollm2, monkeypatch):
    cache = SequenceCache(smollm2.config, 32)
    prompt = [1, 504, 3458, 314]
    prefill(smollm2.decoder, cache, prompt)
    expected = decode(smollm2.decoder, _fresh(smollm2, prompt), 42)

    original_write = cache.store.write

    def write_then_fail(layer, rows, k, v):
        original_write(layer, rows, k, v)
        if layer == smollm2.config.n_layer // 2:
            raise _FailingLayer(f"injected at layer {layer}")

    monkeypatch.setattr(cache.store, "write", write_then_fail)
    with pytest.raises(_FailingLayer):
        decode(smollm2.decoder, cache, 42)
    assert cache.length == len(prompt)
    monkeypatch.setattr(cache.store, "write", original_write)
    # The half-written row is invisible and gets overwritten: the retry equals a clean run.
    assert torch.equal(decode(smollm2.decoder, cache, 42), expected)


def _fresh(model, prompt):
    cache = SequenceCache(model.config, 32)
    prefill(model.decoder, cache, prompt)
    return cache


def test_reset_keeps_the_allocation_and_starts_over(smollm2):
    cache = SequenceCache(smollm2.config, 16)
    first = prefill(smollm2.decoder, cache, [1, 2, 3])
    k_ptr, v_ptr = cache.store.k.data.data_ptr(), cache.store.v.data.data_ptr()
    cache.reset()
    assert cache.length == 0
    assert (cache.store.k.data.data_ptr(), cache.store.v.data.data_ptr()) == (k_ptr, v_ptr)
    assert torch.equal(prefill(smollm2.decoder, cache, [1, 2, 3]), first)
