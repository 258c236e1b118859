"""The packed-model cache: a second load maps the packed model back, with the same logits as a fresh load."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import one_batch
from kvlm import Context, DecodeStatus, pack_cache
from kvlm.load import load_model
from kvlm.model.settings import resolve_settings


@pytest.fixture
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv(pack_cache.SWITCH_VARIABLE, "1")
    monkeypatch.setattr(pack_cache, "cache_dir", lambda: tmp_path / "packed")
    return tmp_path / "packed"


def last_logits(model, ids):
    ctx = Context(model, n_ctx=64, n_seq_max=1, kv_dtype="f32")
    assert ctx.decode(one_batch([ids])) == DecodeStatus.OK
    return ctx.get_logits_ith(-1)


@pytest.mark.parametrize("dtype, quant", [("float32", None), ("bfloat16", "auto"), ("bfloat16", "int4")])
def test_a_second_load_comes_from_the_cache_with_the_same_logits(smollm2_gguf_path, cache_in_tmp, monkeypatch,
                                                                   dtype, quant):
    fresh = load_model(str(smollm2_gguf_path), dtype, quant=quant)
    assert len(list(cache_in_tmp.glob("*.pt"))) == 1
    from kvlm.loader import gguf_file
    monkeypatch.setattr(gguf_file, "load_gguf", lambda *a: pytest.fail("the file was read again"))
    cached = load_model(str(smollm2_gguf_path), dtype, quant=quant)
    ids = fresh.tokenizer.encode("The packed model comes back")
    assert cached.tokenizer.encode("The packed model comes back") == ids
    assert cached.decoder.describe() == fresh.decoder.describe()
    # The same tensors through the same kernels: equal by construction.
    assert torch.equal(last_logits(cached, ids), last_logits(fresh, ids))


def test_other_settings_or_a_changed_file_are_misses(smollm2_gguf_path, cache_in_tmp, tmp_path):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(smollm2_gguf_path.read_bytes())
    first = pack_cache.entry_path(copy, resolve_settings("float32", None))
    assert pack_cache.entry_path(copy, resolve_settings("bfloat16", "int4")) != first
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
    assert pack_cache.entry_path(copy, resolve_settings("float32", None)) != first


def test_a_damaged_entry_is_rebuilt(smollm2_gguf_path, cache_in_tmp):
    settings = resolve_settings("float32", None)
    entry = pack_cache.entry_path(smollm2_gguf_path, settings)
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"not a torch file")
    model = load_model(str(smollm2_gguf_path), "float32", quant=None)
    assert model.config.n_layer == 30
    assert pack_cache.load(smollm2_gguf_path, settings) is not None  # rewritten whole


def test_the_cache_keeps_only_the_newest_entries(cache_in_tmp, tmp_path):
    settings = resolve_settings("float32", None)
    for i in range(pack_cache.KEEP_ENTRIES + 2):
        source = tmp_path / f"model{i}.gguf"
        source.write_bytes(b"x")
        pack_cache.save(source, settings, {"i": i})
        entry = pack_cache.entry_path(source, settings)
        os.utime(entry, ns=(10**18 + i, 10**18 + i))  # mtimes in write order even on coarse clocks
    assert len(list(cache_in_tmp.glob("*.pt"))) == pack_cache.KEEP_ENTRIES


def test_an_unwritable_cache_only_logs(smollm2_gguf_path, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(pack_cache.SWITCH_VARIABLE, "1")
    monkeypatch.setattr(pack_cache, "cache_dir", lambda: blocker / "packed")  # a directory under a file
    pack_cache.save(smollm2_gguf_path, resolve_settings("float32", None), {"x": 1})
    assert "could not write the packed-model cache" in caplog.text
