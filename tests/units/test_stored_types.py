"""How the file's tensor types are held, said truly, and a type nothing here reads refused before any weight is:
the start line names the block types held as stored, and a tensor of a type kvlm does not read (Q8_1, a type of
llama.cpp's intermediate results) fails the load naming it."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from helpers.family_factory import SPECS, family_gguf_metadata, family_gguf_tensors, random_model
from helpers.gguf_factory import add_value
from kvlm.core.errors import ModelFileError
from kvlm.loader.gguf_reader import GGUFFile
from kvlm.loader.load import load_model
from kvlm.model.settings import resolve_settings

SPEC = SPECS["llama-llama3"]


def test_every_block_type_is_said_to_be_held_as_stored():
    settings = resolve_settings("auto", "auto", kernels=True)
    said = settings.describe(["F32", "Q4_K", "Q6_K", "Q3_K", "IQ4_XS", "IQ1_S"])
    assert "as the file stores them (IQ1_S, IQ4_XS, Q3_K, Q4_K, Q6_K blocks, read by native kernels)" in said
    assert "dequantized" not in said
    assert "blocks" not in resolve_settings("float32", None).describe(["Q3_K"])  # dense anyway


def test_the_start_line_knows_the_files_types(tmp_path):
    from helpers.gguf_factory import write_gguf

    model = random_model(SPEC)
    path = write_gguf(tmp_path / "q8.gguf", family_gguf_metadata(model, SPEC), family_gguf_tensors(model, SPEC),
                      arch=SPEC.arch, quant=GGMLQuantizationType.Q8_0)
    decoder = load_model(str(path), progress=False).decoder
    assert decoder.stored_as == ["F32", "Q8_0"]
    assert "(Q8_0 blocks, read by native kernels)" in decoder.describe() or not decoder.quantized  # no compiler: dense


def test_a_type_nothing_reads_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    model = random_model(SPEC)
    writer = GGUFWriter(tmp_path / "q8_1.gguf", SPEC.arch)
    for key, value in family_gguf_metadata(model, SPEC).items():
        add_value(writer, key, value)
    for name, array in family_gguf_tensors(model, SPEC).items():
        if name == "blk.1.attn_q.weight":
            weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
            writer.add_tensor(name, np.zeros((array.shape[0], array.shape[1] // weights * nbytes), dtype=np.uint8),
                              raw_dtype=GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config_vector = GGUFFile(tmp_path / "q8_1.gguf").tensors["rope_freqs.weight"].offset  # (read with the config)
    read, read_into = [], GGUFFile.read_into

    def recorded(self, out, offset):
        read.append(offset)
        read_into(self, out, offset)

    monkeypatch.setattr(GGUFFile, "read_into", recorded)
    with pytest.raises(ModelFileError, match=r"tensor blk.1.attn_q.weight is stored as Q8_1, a type kvlm cannot read "
                                             r"\(it reads BF16, F16, F32, IQ1_M, "):
        load_model(str(tmp_path / "q8_1.gguf"), progress=False)
    assert set(read) <= {config_vector}
