"""A model's second load takes its matrices from the tile cache the first one wrote (kvlm.loader.tile_cache): every
matrix the kernels read in tiles comes mapped from the cache, byte for byte what the first load rearranged, so the
logits are the same bits; a changed model file or the cache turned off reads the file again."""
from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType

from helpers.gguf_factory import llama_config, random_llama, write_model_gguf
from helpers.models import full_sequence_logits, token_ids
from kvlm.kernels import native_kernels
from kvlm.loader import tile_cache
from kvlm.loader.load import load_model, load_rank
from kvlm.model.linear import QuantizedLinear

pytestmark = pytest.mark.skipif(native_kernels() is None or not native_kernels().tiles,
                                reason="the tile cache keeps the native kernels' tiles")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    config = llama_config(hidden_size=128, n_head=4, n_head_kv=2, n_layer=2, intermediate_size=256,
                          tie_word_embeddings=False)
    return write_model_gguf(random_llama(config, seed=3), tmp_path_factory.mktemp("tiles") / "model.gguf",
                            quant=GGMLQuantizationType.Q8_0)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tile_cache.DIRECTORY_VARIABLE, str(tmp_path / "tiles"))
    monkeypatch.setattr(tile_cache, "MIN_BYTES", 0)  # (a small model's tiles are kept too)
    return tmp_path / "tiles"


@pytest.fixture
def mapped_entries(monkeypatch) -> list[str]:
    """The keys of the entries loads took from a tiles file."""
    taken, get = [], tile_cache.MappedTiles.get

    def counted(self, key, expected):
        found = get(self, key, expected)
        taken.extend([key] if found is not None else [])
        return found

    monkeypatch.setattr(tile_cache.MappedTiles, "get", counted)
    return taken


def tiled_parts(model) -> list:
    return [part for m in model.decoder.matrices() if isinstance(m, QuantizedLinear) for part in m.parts
            if part.interleaved]


def load(path):
    model = load_model(str(path), progress=False)
    tile_cache.WRITER.submit(lambda: None).result()  # (the tiles file written, if it is to be)
    return model


def test_the_second_load_maps_every_tiled_matrix_and_computes_the_same_bits(gguf_path, cache_dir, mapped_entries):
    first = load(gguf_path)
    made = tiled_parts(first)
    assert made and not mapped_entries
    assert len(list(cache_dir.glob("*.tiles"))) == 1

    second = load(gguf_path)
    mapped = tiled_parts(second)
    assert len(mapped_entries) == len(made) == len(mapped)
    for a, b in zip(made, mapped):
        assert a.qtype == b.qtype and torch.equal(a.blocks, b.blocks)
    ids = token_ids(first.config.vocab_size, 12)
    assert torch.equal(full_sequence_logits(first, ids), full_sequence_logits(second, ids))


def test_a_changed_model_file_is_read_again(gguf_path, cache_dir, mapped_entries):
    load(gguf_path)
    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load(gguf_path)
    assert not mapped_entries
    assert len(list(cache_dir.glob("*.tiles"))) == 2  # (the older one goes when the cache needs its room)


def test_with_the_cache_off_nothing_is_written_or_mapped(gguf_path, cache_dir, monkeypatch, mapped_entries):
    monkeypatch.setenv(tile_cache.DIRECTORY_VARIABLE, "0")
    load(gguf_path)
    load(gguf_path)
    assert not mapped_entries and not cache_dir.exists()


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    """A small Qwen3-MoE file of Q8_0 blocks, experts stacked as llama.cpp's converter writes them."""
    from helpers.moe_factory import SPECS, random_moe, save_moe_folder, write_moe_gguf

    folder = tmp_path_factory.mktemp("moe")
    model = random_moe(SPECS["qwen3moe"])
    hf = save_moe_folder(model, folder / "hf")
    return write_moe_gguf(model, SPECS["qwen3moe"], hf, folder / "moe.gguf", GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_each_tensor_parallel_rank_keeps_and_maps_its_own_part(model, gguf_path, moe_path, cache_dir,
                                                               mapped_entries, monkeypatch):
    """A rank reads its rows or columns of each matrix (of each expert's): its own file, whose entries are its
    parts. A worker rank writes its file before its load returns (rank 0 ends it soon after a stop)."""
    path = str(gguf_path if model == "dense" else moe_path)
    worker = load_rank(path, 1, 2)
    assert len(list(cache_dir.glob("*.tiles"))) == 1
    ranks = [load_rank(path, 0, 2), worker]
    tile_cache.WRITER.submit(lambda: None).result()
    assert len(list(cache_dir.glob("*.tiles"))) == 2 and not mapped_entries
    writes, write = [], tile_cache.write_tiles
    monkeypatch.setattr(tile_cache, "write_tiles", lambda *args: writes.append(args[0]) or write(*args))
    keys = []
    for rank, first in enumerate(ranks):
        mapped_entries.clear()
        second = load_rank(path, rank, 2)
        made, mapped = tiled_parts(first), tiled_parts(second)
        assert made and len(made) == len(mapped) <= len(mapped_entries)
        for a, b in zip(made, mapped):
            assert a.shape == b.shape and torch.equal(a.blocks, b.blocks)
        keys.append(set(mapped_entries))
    assert not keys[0] & keys[1]  # every tiled matrix a part of its own (rows or columns) on each rank
    if model == "moe":
        assert any("_exps" in key for key in keys[1])
    tile_cache.WRITER.submit(lambda: None).result()
    assert not writes  # everything was mapped: nothing written again
