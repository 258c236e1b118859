"""Models in every 1- to 4-bit GGUF type (Q2_K, Q3_K, the I-quants, TQ1_0/TQ2_0, NVFP4), read by kvlm in their blocks:
float32 greedy ids equal transformers' on the same file (transformers dequantizes with gguf).

Two kinds of files: a random Llama whose matrices are random blocks of one type (every type, wherever these tests
run: gguf can quantize few of them), and the same Llama's float weights quantized into each of llama.cpp's file types
by llama.cpp's own quantizer (where llama-cpp-python is installed: a bench extra), so that every tensor's type is
the one llama.cpp's mix gives it. On the latter, kvlm's defaults (the native products, 8-bit activations) must also
agree with its float32 top-1 on nearly every position; random blocks make a chaotic model (weights far larger than
a trained model's), where the 8-bit activations' rounding alone flips near-ties, so there the kernels' own tests
(tests/kernels) hold the products to their definition instead.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFReader

from helpers.blocks import random_blocks
from helpers.gguf_factory import gguf_metadata, gguf_tensors, llama_config, random_llama, write_gguf, write_model_gguf
from helpers.models import assert_greedy_generate_equals_transformers, full_sequence_logits, hf_model_of, token_ids
from kvlm.kernels import NATIVE_TYPES, native_kernels
from kvlm.loader.load import load_model
from kvlm.model.linear import linear_kind

LOW_BIT_TYPES = sorted(NATIVE_TYPES - {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4},
                       key=int)
# llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*) and the tensor type each must contain; the I-quants below 3 bits
# (and IQ3_XXS) are refused by llama.cpp's quantizer without an importance matrix.
LLAMA_CPP_FILE_TYPES = {"Q2_K": (10, T.Q2_K), "Q3_K_S": (11, T.Q3_K), "Q3_K_M": (12, T.Q3_K), "Q3_K_L": (13, T.Q3_K),
                        "IQ4_NL": (25, T.IQ4_NL), "IQ4_XS": (30, T.IQ4_XS), "IQ3_S": (26, T.IQ3_S),
                        "IQ3_M": (27, T.IQ3_S), "TQ2_0": (37, T.TQ2_0),
                        "TQ1_0": (36, T.TQ1_0)}
CONFIG = dict(hidden_size=256, intermediate_size=512, n_head=4, n_head_kv=2, n_layer=2)  # rows of whole 256-blocks
N_GREEDY = 12
# Of the positions where the defaults' top-1 is float32's. The random Llama's logits have near-ties that 8-bit
# activations tip: Q8_0 and Q4_K_M files of it (types read natively for long) agree on 0.89 of them, the low-bit
# types on 0.84-0.93; a wrong kernel agrees by chance (1 in 1000).
AGREEMENT = 0.8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference_llama():
    return random_llama(llama_config(**CONFIG), seed=5)


def random_blocks_file(folder, reference, qtype: T):
    """The Llama's shapes with random blocks of `qtype` as every matrix (norms F32)."""
    seeds = iter(range(100))
    return write_gguf(folder / f"{qtype.name}.gguf", gguf_metadata(reference.config), gguf_tensors(reference),
                      quant=qtype, blocks_of=lambda name, array: random_blocks(qtype, *array.shape, seed=next(seeds)))


def llama_cpp_file(folder, reference, file_type: str):
    """The Llama's float weights quantized by llama.cpp into `file_type`."""
    llama_cpp = pytest.importorskip("llama_cpp")
    source = write_model_gguf(reference, folder / "f32.gguf")
    target = folder / f"{file_type}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = LLAMA_CPP_FILE_TYPES[file_type][0], 1
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0
    return target


def assert_reads_like_transformers(path, vocab_size: int) -> None:
    prompts = [token_ids(vocab_size, 9, seed=s) for s in (1, 2)]
    assert_greedy_generate_equals_transformers(path, hf_model_of(path), prompts, N_GREEDY, n_ctx=64)


def defaults_agreement(path, vocab_size: int) -> float:
    """The share of positions of a 96-token sequence where the defaults' top-1 is float32's."""
    if native_kernels() is None:
        pytest.skip("the defaults are float32 itself where the native kernels cannot be built")
    ids = token_ids(vocab_size, 96, seed=3)
    exact = full_sequence_logits(load_model(str(path), "float32", progress=False), ids).argmax(-1)
    defaults = full_sequence_logits(load_model(str(path), progress=False), ids).argmax(-1)
    return (exact == defaults).float().mean().item()


@pytest.mark.parametrize("qtype", LOW_BIT_TYPES, ids=lambda t: t.name)
def test_a_file_of_random_blocks_reads_as_transformers_reads_it(tmp_path, reference_llama, qtype):
    path = random_blocks_file(tmp_path, reference_llama, qtype)
    model = load_model(str(path), progress=False)
    if native_kernels() is not None:  # held in its blocks, not dequantized at load
        assert {linear_kind(m) for m in model.decoder.matrices()} == {qtype.name}
        assert "dequantized" not in model.decoder.describe()
    assert_reads_like_transformers(path, reference_llama.config.vocab_size)


@pytest.mark.parametrize("file_type", list(LLAMA_CPP_FILE_TYPES))
def test_a_file_quantized_by_llama_cpp_reads_as_transformers_reads_it(tmp_path, reference_llama, file_type):
    path = llama_cpp_file(tmp_path, reference_llama, file_type)
    types = {tensor.tensor_type for tensor in GGUFReader(path).tensors}
    assert LLAMA_CPP_FILE_TYPES[file_type][1] in types, f"llama.cpp wrote {sorted(t.name for t in types)}"
    assert_reads_like_transformers(path, reference_llama.config.vocab_size)
    assert defaults_agreement(path, reference_llama.config.vocab_size) >= AGREEMENT


def test_quantized_and_float_logits_are_close_on_a_llama_cpp_file(tmp_path, reference_llama):
    """float32 logits of a Q3_K_M file within 1e-4 of transformers' on the same dequantized weights."""
    path = llama_cpp_file(tmp_path, reference_llama, "Q3_K_M")
    ids = token_ids(reference_llama.config.vocab_size, 16, seed=4)
    with torch.no_grad():
        expected = hf_model_of(path)(torch.tensor([ids])).logits[0].float()
    ours = full_sequence_logits(load_model(str(path), "float32", progress=False), ids)
    assert (ours - expected).abs().max().item() <= 1e-4
