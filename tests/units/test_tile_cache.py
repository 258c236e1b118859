"""The tile cache's file (kvlm.loader.tile_cache): matrices written and mapped back as the same bytes, entries taken
only where they are what the model's file says, damaged files deleted, the directory kept within its size and the
disk's reserve, a failed write a warning; and a GGUF's blocks kept as stored mapped privately from the file."""
from __future__ import annotations

import logging
import os
from collections import namedtuple

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from helpers.blocks import random_blocks
from kvlm.kernels import BlockMatrix
from kvlm.loader import tile_cache
from kvlm.loader.gguf_reader import GGUFFile
from kvlm.loader.tensors import Entry, GGUFTensors
from kvlm.loader.tile_cache import MappedTiles, TileCache, entry_key, tile_cache_for, write_tiles

MiB = 1 << 20


def tiles(qtype: T, rows: int, cols: int, seed: int) -> BlockMatrix:
    """Random blocks standing for a matrix already rearranged in tiles (the cache copies bytes; it never reads them)."""
    blocks = torch.from_numpy(random_blocks(qtype, rows, cols, seed=seed).reshape(rows, -1).copy())
    return BlockMatrix(blocks, qtype, cols, interleaved=True)


def entry_of(matrix: BlockMatrix) -> Entry:
    return Entry(matrix.shape, matrix.qtype.name, matrix.nbytes)


@pytest.fixture
def matrices() -> dict[str, BlockMatrix]:
    return {entry_key("blk.0.attn_q.weight", None, None): tiles(T.Q4_K, 24, 512, 1),
            entry_key("blk.0.ffn_down.weight", slice(0, 16), None): tiles(T.Q6_K, 16, 256, 2),
            entry_key("output.weight", None, None): tiles(T.Q8_0, 40, 96, 3)}


def test_matrices_written_come_back_mapped_as_the_same_bytes_each_at_a_page(tmp_path, matrices):
    path = tmp_path / "model.tiles"
    assert write_tiles(path, matrices, limit=1 << 30)
    mapped = MappedTiles.open(path)
    for key, matrix in matrices.items():
        got = mapped.get(key, entry_of(matrix))
        assert got.interleaved and got.qtype == matrix.qtype and got.n_cols == matrix.n_cols
        assert torch.equal(got.blocks, matrix.blocks)
        assert mapped.index[key][0] % tile_cache.PAGE == 0
    assert mapped.get(entry_key("blk.1.attn_q.weight", None, None), entry_of(matrices[next(iter(matrices))])) is None


def test_a_write_into_a_mapped_matrix_never_reaches_the_file(tmp_path, matrices):
    path = tmp_path / "model.tiles"
    write_tiles(path, matrices, limit=1 << 30)
    before = path.read_bytes()
    key, matrix = next(iter(matrices.items()))
    MappedTiles.open(path).get(key, entry_of(matrix)).blocks.fill_(7)
    assert path.read_bytes() == before


@pytest.mark.parametrize("unlike", ["type", "bytes", "width"])
def test_an_entry_unlike_the_model_files_tensor_is_not_taken(tmp_path, matrices, unlike):
    path = tmp_path / "model.tiles"
    write_tiles(path, matrices, limit=1 << 30)
    key, matrix = next(iter(matrices.items()))
    expected = entry_of(matrix)
    changed = {"type": Entry(expected.shape, "Q5_K", expected.nbytes),
               "bytes": Entry(expected.shape, expected.stored_as, expected.nbytes + 144),
               "width": Entry((expected.shape[0], expected.shape[1] + 256), expected.stored_as, expected.nbytes)}
    assert MappedTiles.open(path).get(key, changed[unlike]) is None


@pytest.mark.parametrize("damage", ["truncated", "not_tiles", "bad_index", "empty"])
def test_a_damaged_file_is_deleted_with_a_warning_and_not_used(tmp_path, matrices, damage, caplog):
    path = tmp_path / "model.tiles"
    write_tiles(path, matrices, limit=1 << 30)
    data = path.read_bytes()
    damaged = {"truncated": data[:len(data) - tile_cache.PAGE], "not_tiles": b"GGUF" + data[4:],
               "bad_index": data[:len(tile_cache.MAGIC) + 8] + b"{not json" + data[len(tile_cache.MAGIC) + 17:],
               "empty": b""}
    path.write_bytes(damaged[damage])
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        assert MappedTiles.open(path) is None
    assert not path.exists()
    assert "model.tiles not used and deleted" in caplog.text


def test_a_file_that_cannot_be_mapped_is_left_alone(tmp_path, matrices, monkeypatch, caplog):
    path = tmp_path / "model.tiles"
    write_tiles(path, matrices, limit=1 << 30)

    def no_room(*_):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(tile_cache, "private_map", no_room)
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        assert MappedTiles.open(path) is None
    assert path.exists() and "model.tiles not used: [Errno 12]" in caplog.text


def test_a_damaged_file_that_cannot_be_deleted_is_only_passed_over(tmp_path, monkeypatch):
    path = tmp_path / "model.tiles"
    path.write_bytes(b"damaged")

    def read_only(*_, **__):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "unlink", read_only)
    assert MappedTiles.open(path) is None


def test_a_header_longer_than_its_file_is_damage(tmp_path, matrices):
    path = tmp_path / "model.tiles"
    write_tiles(path, matrices, limit=1 << 30)
    data = bytearray(path.read_bytes())
    data[len(tile_cache.MAGIC):len(tile_cache.MAGIC) + 8] = (1 << 62).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    assert MappedTiles.open(path) is None and not path.exists()


def test_no_file_is_no_tiles(tmp_path):
    assert MappedTiles.open(tmp_path / "none.tiles") is None


def test_the_least_recently_used_files_make_room_within_the_limit(tmp_path, matrices):
    size = sum(tile_cache._page_up(m.nbytes) for m in matrices.values()) + tile_cache.PAGE
    older, old, new = (tmp_path / f"{name}.tiles" for name in ("older", "old", "new"))
    for age, path in enumerate((older, old)):
        assert write_tiles(path, matrices, limit=3 * size)
        os.utime(path, ns=(10**18 + age, 10**18 + age))
    other = tmp_path / "notes.txt"
    other.write_text("not a tiles file")
    assert write_tiles(new, matrices, limit=2 * size)
    assert not older.exists() and old.exists() and new.exists() and other.exists()


def test_tiles_larger_than_the_limit_are_not_written(tmp_path, matrices, caplog):
    path = tmp_path / "model.tiles"
    with caplog.at_level(logging.INFO, logger="kvlm"):
        assert not write_tiles(path, matrices, limit=MiB // 64)
    assert not path.exists() and "exceed the cache's" in caplog.text


def test_a_disk_short_of_its_reserve_gets_no_file_and_keeps_the_others(tmp_path, matrices, monkeypatch, caplog):
    other = tmp_path / "other.tiles"
    write_tiles(other, matrices, limit=1 << 30)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(tile_cache.shutil, "disk_usage", lambda _: usage(100 << 30, 100 << 30, 0))
    path = tmp_path / "model.tiles"
    with caplog.at_level(logging.INFO, logger="kvlm"):
        assert not write_tiles(path, matrices, limit=1 << 30)
    assert not path.exists() and "free beside it" in caplog.text
    assert other.exists()  # (deleting it would not have made room enough: it stays)


def test_a_disk_short_of_its_reserve_makes_room_from_the_least_recently_used(tmp_path, matrices, monkeypatch):
    older, old = tmp_path / "older.tiles", tmp_path / "old.tiles"
    for age, path in enumerate((older, old)):
        write_tiles(path, matrices, limit=1 << 30)
        os.utime(path, ns=(10**18 + age, 10**18 + age))
    usage = namedtuple("usage", "total used free")
    free = tile_cache.RESERVE + older.stat().st_size - 1  # (room for the new file once one old one is gone)
    monkeypatch.setattr(tile_cache.shutil, "disk_usage", lambda _: usage(100 << 30, 99 << 30, free))
    assert write_tiles(tmp_path / "new.tiles", matrices, limit=1 << 30)
    assert not older.exists() and old.exists()


def test_a_failed_write_is_a_warning_and_leaves_nothing_behind(tmp_path, matrices, caplog):
    blocked = tmp_path / "a_file"
    blocked.write_text("a file where the directory would be")
    with caplog.at_level(logging.WARNING, logger="kvlm"):
        assert not write_tiles(blocked / "model.tiles", matrices, limit=1 << 30)
    assert "not written" in caplog.text and blocked.read_text().startswith("a file")


def test_a_load_writes_its_tiles_only_where_it_made_enough_of_them(tmp_path, matrices):
    path = tmp_path / "model.tiles"
    made = TileCache(path, limit=1 << 30, min_bytes=10 * MiB)
    for key, matrix in matrices.items():
        assert made.read((key, None, None), entry_of(matrix), lambda m=matrix: m) is matrix
    made.save()
    assert made.saved is None and not path.exists()  # below min_bytes

    cache = TileCache(path, limit=1 << 30, min_bytes=0)
    parts = {(f"t{i}", None, None): m for i, m in enumerate(matrices.values())}
    for part, matrix in parts.items():
        cache.read(part, entry_of(matrix), lambda m=matrix: m)
    cache.read(("as_stored", None, None), Entry((8, 32), "Q8_0", 272),
               lambda: BlockMatrix(torch.zeros(8, 34, dtype=torch.uint8), T.Q8_0, 32))  # (not in tiles: not kept)
    cache.save()
    assert cache.saved.result() and path.exists()

    again = TileCache(path, limit=1 << 30, min_bytes=0)
    for part, matrix in parts.items():
        got = again.read(part, entry_of(matrix), lambda: pytest.fail("made although the file holds it"))
        assert torch.equal(got.blocks, matrix.blocks)
    mtime = path.stat().st_mtime_ns
    again.save()
    assert again.saved is None and path.stat().st_mtime_ns == mtime  # everything was mapped: nothing to write


def test_the_cache_is_off_or_where_the_variable_says(tmp_path, monkeypatch):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    for off in ("0", "off"):
        monkeypatch.setenv(tile_cache.DIRECTORY_VARIABLE, off)
        assert tile_cache_for([model], "kernels", (0, 1)) is None
    monkeypatch.setenv(tile_cache.DIRECTORY_VARIABLE, str(tmp_path / "tiles"))
    monkeypatch.setenv(tile_cache.SIZE_VARIABLE, "3G")
    cache = tile_cache_for([model], "kernels", (0, 1))
    assert cache.path.parent == tmp_path / "tiles" and cache.limit == 3 << 30


def test_the_files_name_changes_with_the_model_file_the_kernels_and_the_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(tile_cache.DIRECTORY_VARIABLE, str(tmp_path / "tiles"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF one")
    name = lambda kernels="k", rank=(0, 1): tile_cache_for([model], kernels, rank).path.name  # noqa: E731
    first = name()
    assert name() == first
    assert len({first, name(kernels="other"), name(rank=(1, 2))}) == 3
    os.utime(model, ns=(1, 1))
    assert name() != first


def test_blocks_kept_as_stored_are_the_files_bytes_mapped_privately(tmp_path):
    from gguf import GGUFReader, GGUFWriter

    path = tmp_path / "blocks.gguf"
    writer = GGUFWriter(path, "llama")
    matrix = random_blocks(T.Q4_K, 16, 512, seed=4)
    writer.add_tensor("token_embd.weight", matrix, raw_dtype=T.Q4_K)
    writer.add_tensor("other.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight").data
    before = path.read_bytes()
    reader = GGUFTensors(GGUFFile(path))
    for rows in (None, slice(3, 11)):
        kept = reader.read("token_embd.weight", rows)
        assert not kept.interleaved
        assert np.array_equal(kept.blocks.numpy(), np.asarray(expected).reshape(16, -1)[rows or slice(None)])
        kept.blocks.fill_(0)  # a private map: the file keeps its bytes
    assert path.read_bytes() == before


def test_kept_tiles_name_the_model_files_they_were_made_from(tmp_path, matrices, monkeypatch):
    monkeypatch.setenv(tile_cache.DIRECTORY_VARIABLE, str(tmp_path / "tiles"))
    model, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"GGUF")
    other.write_bytes(b"GGUF")
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    write_tiles(tmp_path / "tiles" / "a.tiles", matrices, 1 << 30, [str(model.resolve())])
    (tmp_path / "tiles" / "b.tiles").write_bytes(b"not a tiles file")
    kept = tile_cache.kept_tiles()
    assert [(k.path.name, k.files) for k in kept] == [("a.tiles", (str(model.resolve()),))]
    assert [k.path.name for k in tile_cache.tiles_of([link])] == ["a.tiles"]  # (a Hub snapshot's link to its blob)
    assert tile_cache.tiles_of([other]) == []
