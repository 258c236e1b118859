"""A model in several GGUF files (split as llama.cpp's converter splits with --split-max-tensors, here gguf's own
GGUFWriter): given by any of its parts it loads all of them, and computes what the single file computes, bit for
bit; a missing part, a part of another split, or a part renamed is refused, naming the file."""
from __future__ import annotations

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType

from helpers.family_factory import SPECS, family_gguf_metadata, family_gguf_tensors, random_model
from helpers.gguf_factory import write_gguf
from helpers.models import prefill_then_decode_logits
from kvlm.core.errors import ModelFileError
from kvlm.loader.gguf_split import SplitGGUF, open_gguf
from kvlm.loader.load import load_model
from kvlm.server.serve import served_name

SPEC = SPECS["llama-llama3"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same random model as one Q8_0 file and as parts of at most 4 tensors (norms in F32)."""
    folder = tmp_path_factory.mktemp("split")
    model = random_model(SPEC)
    metadata, tensors = family_gguf_metadata(model, SPEC), family_gguf_tensors(model, SPEC)
    write = lambda path, **kw: write_gguf(path, metadata, tensors, arch=SPEC.arch,  # noqa: E731
                                          quant=GGMLQuantizationType.Q8_0, **kw)
    single = write(folder / "whole.gguf")
    first = write(folder / "model.gguf", split_max_tensors=4)
    other = write(tmp_path_factory.mktemp("other") / "model.gguf", split_max_tensors=6)
    return single, first, other


def _parts(first):
    return sorted(first.parent.glob("model-*-of-*.gguf"))


def test_any_part_loads_the_whole_model_as_the_single_file_does(files):
    single, first, _ = files
    parts = _parts(first)
    assert first.name.endswith("-00001-of-%05d.gguf" % len(parts)) and len(parts) >= 3
    ids = [1, 5, 9, 14, 3, 7, 11]
    for mode in ({"dtype": "float32", "quant": None}, {}):  # dense float32; the defaults (blocks where native)
        want = prefill_then_decode_logits(load_model(str(single), progress=False, **mode), ids, 4)
        for part in (parts[0], parts[-1]):
            got = prefill_then_decode_logits(load_model(str(part), progress=False, **mode), ids, 4)
            assert torch.equal(got, want)


def test_the_parts_read_as_one_file(files):
    single, first, _ = files
    whole, split = open_gguf(single), open_gguf(first)
    assert isinstance(split, SplitGGUF) and len(split.parts) == len(_parts(first))
    assert list(split.tensors) == list(whole.tensors)
    for name, info in whole.tensors.items():
        a, b = torch.empty(info.nbytes, dtype=torch.uint8), torch.empty(info.nbytes, dtype=torch.uint8)
        whole.read_into(a, info.offset)
        split.read_into(b, split.tensors[name].offset)
        assert torch.equal(a, b), name
    assert split.metadata["general.architecture"] == whole.metadata["general.architecture"]
    split.close()
    whole.close()


def test_a_missing_part_is_refused_by_name(files, tmp_path):
    _, first, _ = files
    parts = _parts(first)
    for part in parts:
        shutil.copy(part, tmp_path / part.name)
    (tmp_path / parts[1].name).unlink()
    with pytest.raises(ModelFileError, match=rf"{parts[1].name}: part 2 of {len(parts)} of the split model is missing"):
        load_model(str(tmp_path / parts[0].name), progress=False)


def test_a_part_of_another_split_is_refused(files, tmp_path):
    _, first, other = files
    parts = _parts(first)
    for part in parts:
        shutil.copy(part, tmp_path / part.name)
    shutil.copy(sorted(other.parent.glob("model-*.gguf"))[1], tmp_path / parts[1].name)
    with pytest.raises(ModelFileError, match=rf"{parts[1].name}: named part 2 of {len(parts)} of a split model, but "
                                             r"its metadata says split.no 1 of split.count \d"):
        load_model(str(tmp_path / parts[0].name), progress=False)


def test_a_renamed_part_is_refused(files, tmp_path):
    _, first, _ = files
    renamed = tmp_path / "mine.gguf"
    shutil.copy(first, renamed)
    with pytest.raises(ModelFileError, match="mine.gguf: this file is one of .* parts of a split model, but its name"):
        load_model(str(renamed), progress=False)


def test_a_split_model_is_served_by_its_name():
    assert served_name("/models/Qwen2.5-7B-Instruct-Q4_K_M-00001-of-00002.gguf") == "Qwen2.5-7B-Instruct-Q4_K_M"
    assert served_name("/models/qwen.gguf") == "qwen"
