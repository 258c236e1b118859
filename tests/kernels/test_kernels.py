"""kvlm's kernels against independent references: dequantization bit for bit against gguf's own, products against
their exact definition (8-bit activations, then exact arithmetic), for every instruction set the C++ is built for
here (this CPU's, AVX2 alone, plain C++; AVX-512 without VNNI where the CPU runs it), and the pure-torch path."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from helpers.blocks import SCALES_AT, block_weights, iq1m_scale, random_blocks, scale_width
from kvlm.kernels import NATIVE_TYPES, BlockMatrix, reference
from kvlm.kernels.quantize import quantize_q4_0, quantize_q4_1, quantize_q8_0
from kvlm.loader.gguf_reader import GGUFFile
from kvlm.loader.tensors import GGUFTensors

TYPES = sorted(NATIVE_TYPES, key=int)


def width_for(qtype: T, chunks: float = 2.5) -> int:
    """A row width: whole super-blocks for the 256-weight formats; for the others, a last chunk that is partial."""
    return 512 if block_weights(qtype) == 256 else int(256 * chunks) + (32 if block_weights(qtype) == 32 else 0)


def assert_rounding_close(actual: torch.Tensor, x: torch.Tensor, parts: list[BlockMatrix], relative: float = 1e-5):
    """Within float32 summation rounding of the definition: relative to the sum of the terms' magnitudes."""
    expected = reference.quantized_product(x, parts)
    magnitude = x.abs().double() @ torch.cat([reference.dequantize(p).abs().double() for p in parts]).T
    error = (actual.double() - expected).abs()
    assert (error <= relative * magnitude + 1e-6).all(), f"worst {(error / (magnitude + 1e-9)).max().item():.2e}"


def exact(values: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit (signed zeros and all)."""
    return torch.equal(values.contiguous().view(torch.int32), expected.contiguous().view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_reference_dequantizes_as_gguf_does(qtype):
    raw = random_blocks(qtype, 7, width_for(qtype))
    matrix = BlockMatrix(torch.from_numpy(raw), qtype, width_for(qtype))
    assert exact(reference.dequantize(matrix), torch.from_numpy(gguf_dequantize(raw, qtype)))


def every_exponent_blocks() -> tuple[np.ndarray, torch.Tensor]:
    """MXFP4 blocks with every exponent 0..255 (subnormal scales at 0 and 1, infinite values near 255) and every
    code, 8 rows of 32 blocks, and gguf's values of them."""
    raw = np.empty((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = np.arange(0, 256, 17)  # bytes 0x00, 0x11, .. 0xFF: weights i and 16 + i have code i
    raw = raw.reshape(8, -1)
    with np.errstate(over="ignore"):
        return raw, torch.from_numpy(gguf_dequantize(raw, T.MXFP4))


def test_mxfp4_scales_are_ggufs_at_every_exponent():
    """e = 0, 1 (subnormal 2^-128, 2^-127), 2, 254, 255 and all between, bit for bit, infinities included."""
    raw, expected = every_exponent_blocks()
    assert exact(reference.dequantize(BlockMatrix(torch.from_numpy(raw), T.MXFP4, 32 * 32)), expected)
    assert expected.reshape(256, 32)[[0, 1, 2, 254], 1].tolist() == [2.0**-128, 2.0**-127, 2.0**-126, 2.0**126]


def laid_out(kernels, raw: np.ndarray, qtype: T, cols: int, layout: str) -> BlockMatrix:
    """The blocks as the file has them, or interleaved in tiles of 8 rows where this build reads tiles."""
    matrix = BlockMatrix(torch.from_numpy(raw.copy()), qtype, cols)
    if layout == "file":
        return matrix
    if not kernels.tiled(qtype):
        pytest.skip(f"the {kernels.isa} build reads {qtype.name} in the file's layout only")
    interleaved = kernels.interleave(matrix)
    assert interleaved.interleaved and interleaved.nbytes == raw.nbytes
    return interleaved


LAYOUTS = ("file", "tiles")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_native_kernels_dequantize_as_gguf_does(kernels, qtype, layout):
    raw = random_blocks(qtype, 37 if layout == "file" else 40, width_for(qtype))
    matrix = laid_out(kernels, raw, qtype, width_for(qtype), layout)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype))
    assert exact(kernels.dequantize(matrix), expected)
    assert torch.equal(kernels.dequantize(matrix, torch.bfloat16), expected.to(torch.bfloat16))
    ids = torch.tensor([36, 0, 5, 5, 39 if layout == "tiles" else 1])
    assert exact(kernels.dequantize(matrix, ids=ids), expected[ids])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_native_mxfp4_scales_are_ggufs_at_every_exponent(kernels, layout):
    raw, expected = every_exponent_blocks()
    assert exact(kernels.dequantize(laid_out(kernels, raw, T.MXFP4, 32 * 32, layout)), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_the_native_product_is_its_definition(kernels, qtype, m, layout):
    """8-bit activations (per 32, or per 256 for K-quants) times the exact weights: only float rounding differs."""
    cols = width_for(qtype)
    raw = random_blocks(qtype, 21 if layout == "file" else 24, cols, seed=m)
    plain = BlockMatrix(torch.from_numpy(raw.copy()), qtype, cols)
    matrix = laid_out(kernels, raw, qtype, cols, layout)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    assert_rounding_close(kernels.product([matrix])(x), x, [plain])
    bf16 = kernels.product([matrix])(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    assert_rounding_close(bf16, x.bfloat16().float(), [plain], relative=2**-8)  # the output rounded to bf16
    # the same sums as from float32 activations of the same values, rounded as torch rounds (stored a register of
    # rows at a time by the tiles)
    rounded = kernels.product([matrix])(x.bfloat16().float()).bfloat16()
    assert torch.equal(bf16.view(torch.int16), rounded.view(torch.int16))  # bit for bit
    # float32 out of bfloat16 activations (the logits): those sums before the rounding, bit for bit
    sums = kernels.product([matrix])(x.bfloat16(), torch.float32)
    assert sums.dtype == torch.float32 and torch.equal(sums, kernels.product([matrix])(x.bfloat16().float()))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_tiles_levels_span_every_value(kernels, qtype):
    """Levels at their extremes (every bit of the fifth and high planes set, the largest activations): no int16
    sum of the tile kernels, or of the row kernels for the formats without tiles, overflows."""
    cols = width_for(qtype)
    raw = random_blocks(qtype, 16, cols, seed=3)
    if qtype != T.Q8_0:
        weights_bytes = np.ones_like(raw, dtype=bool)
        block = GGML_QUANT_SIZES[qtype][1]
        for at in SCALES_AT[qtype]:  # the scales stay as they are
            for start in range(at, raw.shape[1], block):
                weights_bytes[:, start:start + scale_width(qtype)] = False
        # every level (and K-quant scale and min) at its maximum; MXFP4's is code 7's (kvalue 12, level 24)
        raw[weights_bytes] = 0x77 if qtype == T.MXFP4 else 0xFF
        if qtype == T.Q6_K:
            raw.reshape(-1, block)[:, 192:208] = 0x80  # scales of -128
        if qtype == T.IQ1_M:  # its d shares the scale words: a plausible one again
            iq1m_scale(raw.reshape(-1, block), np.random.default_rng(3))
    else:
        raw.reshape(-1, 34)[:, 2:] = 0x80  # -128, the one level below -127
    x = torch.full((2, cols), 3.0)
    x[1, ::2] = -3.0  # activations quantized to +-127
    plain = BlockMatrix(torch.from_numpy(raw.copy()), qtype, cols)
    layout = "tiles" if kernels.tiled(qtype) else "file"
    assert_rounding_close(kernels.product([laid_out(kernels, raw, qtype, cols, layout)])(x), x, [plain])


def test_a_products_rows_do_not_depend_on_the_batch(kernels):
    """A row's arithmetic is the same alone and among others (every way activation rows share a tile's pass)."""
    for qtype in (T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4, T.Q2_K, T.Q3_K, T.IQ4_XS, T.IQ3_S, T.IQ2_XS,
                  T.IQ4_NL):
        layout = "tiles" if kernels.tiled(qtype) else "file"  # the row kernel for the types without tiles
        matrix = laid_out(kernels, random_blocks(qtype, 16, 512), qtype, 512, layout)
        x = torch.randn(7, 512, generator=torch.Generator().manual_seed(int(qtype)))
        together = kernels.product([matrix])(x)
        for i in range(7):
            assert torch.equal(kernels.product([matrix])(x[i:i + 1]), together[i:i + 1]), qtype.name


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_tiles_outputs_do_not_depend_on_the_tile_beside_it(kernels, qtype):
    """With AVX-512 two adjacent tiles share each 512-bit register (lanes.h), an odd one out alone: a matrix of 3
    tiles (a thread's share holds a pair, one alone, or both) gives each tile's outputs the same bits as that tile
    as a matrix of its own (always alone)."""
    cols = width_for(qtype)
    raw = random_blocks(qtype, 24, cols, seed=7)
    x = torch.randn(9, cols, generator=torch.Generator().manual_seed(int(qtype)))
    whole = kernels.product([laid_out(kernels, raw, qtype, cols, "tiles")])(x)
    for tile in range(3):
        alone = kernels.product([laid_out(kernels, raw[8 * tile:8 * tile + 8], qtype, cols, "tiles")])(x)
        assert torch.equal(alone, whole[:, 8 * tile:8 * tile + 8]), tile


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_products_rows_do_not_depend_on_the_rows_a_pass_takes(kernels, qtype):
    """1 to 4 (AVX-512: 8) activation rows per pass over a tile (each build's default per type, dot.h): every count
    is the product's definition, bit for bit the same, tails of the batch included."""
    if not kernels.tiled(qtype):
        pytest.skip(f"the {kernels.isa} build reads {qtype.name} in the file's layout only")
    cols = width_for(qtype)
    raw = random_blocks(qtype, 16, cols, seed=5)
    plain = BlockMatrix(torch.from_numpy(raw.copy()), qtype, cols)
    product = kernels.product([laid_out(kernels, raw, qtype, cols, "tiles")])
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(int(qtype)))
    default = kernels.tile_pass_rows(qtype)
    assert 1 <= default <= kernels.max_tile_pass_rows in (4, 8)
    expected = product(x)
    assert_rounding_close(expected, x, [plain])
    try:
        for rows in range(1, kernels.max_tile_pass_rows + 1):
            kernels.set_tile_pass_rows(qtype, rows)
            assert kernels.tile_pass_rows(qtype) == rows
            assert torch.equal(product(x), expected), rows
    finally:
        kernels.set_tile_pass_rows(qtype, 0)
    assert kernels.tile_pass_rows(qtype) == default


def test_rows_per_pass_out_of_range_are_refused(kernels):
    if not kernels.tiles:
        pytest.skip(f"the {kernels.isa} build reads no tiles")
    default, most = kernels.tile_pass_rows(T.Q4_K), kernels.max_tile_pass_rows
    with pytest.raises(ValueError, match=f"0 \\(the default\\) to {most}, not {most + 1}"):
        kernels.set_tile_pass_rows(T.Q4_K, most + 1)
    with pytest.raises(ValueError, match="IQ2_XS is not read in tiles"):
        kernels.set_tile_pass_rows(T.IQ2_XS, 2)
    assert kernels.tile_pass_rows(T.Q4_K) == default and kernels.tile_pass_rows(T.IQ2_XS) == 0


def test_interleaved_matrices_are_cut_only_between_tiles(kernels):
    matrix = laid_out(kernels, random_blocks(T.Q4_K, 24, 512), T.Q4_K, 512, "tiles")
    expected = kernels.dequantize(matrix)
    assert exact(kernels.dequantize(matrix.rows(slice(8, 24))), expected[8:24])
    with pytest.raises(ValueError, match="cut only between tiles"):
        matrix.rows(slice(4, 12))
    with pytest.raises(ValueError, match="cut only between tiles"):
        matrix.rows(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="cannot be cut by columns"):
        matrix.columns(0, 256)
    with pytest.raises(ValueError, match="reads the file's layout"):
        reference.dequantize(matrix)
    odd = BlockMatrix(torch.from_numpy(random_blocks(T.Q4_K, 12, 512)), T.Q4_K, 512)
    assert kernels.interleave(odd) is odd  # rows that do not fill whole tiles stay as the file has them


def test_stacked_parts_of_different_formats_are_one_product(kernels):
    """Q/K/V stored as Q4_K, Q4_K and Q6_K (a Q4_K_M file), or Q5_0 and Q8_0, multiplied in one call."""
    x = torch.randn(5, 512)
    for qtypes in [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q5_0, T.Q8_0), (T.Q4_K, T.Q8_0)]:
        raws = [random_blocks(q, 8 * (i + 1) + (i == 1) * 4, 512, seed=i) for i, q in enumerate(qtypes)]
        plain = [BlockMatrix(torch.from_numpy(raw.copy()), q, 512) for raw, q in zip(raws, qtypes)]
        assert_rounding_close(kernels.product(plain)(x), x, plain)
        # as loaded: parts that fill whole tiles interleaved, the one of 20 rows as the file has it
        loaded = [kernels.interleave(BlockMatrix(torch.from_numpy(raw.copy()), q, 512)) for raw, q in zip(raws, qtypes)]
        assert_rounding_close(kernels.product(loaded)(x), x, plain)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_products_rows_do_not_depend_on_the_threads(kernels, layout):
    matrix = laid_out(kernels, random_blocks(T.Q4_K, 64, 1024), T.Q4_K, 1024, layout)
    x = torch.randn(3, 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.product([matrix])(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(kernels.product([matrix])(x), alone)  # each row is computed by one thread, whole


def test_bad_shapes_are_refused(kernels):
    matrix = BlockMatrix(torch.from_numpy(random_blocks(T.Q8_0, 4, 64)), T.Q8_0, 64)
    with pytest.raises(ValueError, match=r"expected float32 or bfloat16 \[m, 64\]"):
        kernels.product([matrix])(torch.randn(2, 32))
    with pytest.raises(ValueError, match="stacked parts need one width"):
        kernels.product([matrix, BlockMatrix(torch.from_numpy(random_blocks(T.Q8_0, 4, 96)), T.Q8_0, 96)])


@pytest.mark.parametrize("quantize, qtype", [(quantize_q8_0, T.Q8_0), (quantize_q4_0, T.Q4_0),
                                             (quantize_q4_1, T.Q4_1)])
def test_requantizing_makes_ggufs_blocks(quantize, qtype):
    weight = torch.randn(12, 96) * torch.logspace(-3, 1, 12)[:, None]
    weight[0, :32] = 0.0  # a block of zeros
    assert np.array_equal(quantize(weight).blocks.numpy(), gguf_quantize(weight.numpy(), qtype))


FILE_TYPES = [T.F32, T.F16, T.BF16, *TYPES]


def test_every_stored_type_reads_back_as_ggufs_values(tmp_path):
    """Each type a GGUF file may store, written by gguf's writer, read by kvlm's reader and dequantized: gguf's own
    values, bit for bit."""
    writer = GGUFWriter(tmp_path / "types.gguf", "llama")
    raws = {}
    for qtype in FILE_TYPES:
        if qtype in (T.F32, T.F16, T.BF16):
            floats = np.random.default_rng(int(qtype)).standard_normal((6, 256)).astype(np.float32)
            raw = gguf_quantize(floats, qtype) if qtype != T.F32 else floats
        else:
            raw = random_blocks(qtype, 6, 256 if block_weights(qtype) == 256 else 320)
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
        raws[qtype] = raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = GGUFTensors(GGUFFile(tmp_path / "types.gguf"))
    for qtype, raw in raws.items():
        stored = tensors.read(qtype.name)
        values = reference.dequantize(stored) if isinstance(stored, BlockMatrix) else stored.float()
        expected = gguf_dequantize(raw.view(np.uint8) if qtype != T.F32 else raw, qtype)
        assert exact(values, torch.from_numpy(np.ascontiguousarray(expected))), qtype.name


def test_native_kernels_can_be_switched_off():
    script = "import kvlm.kernels.native as n; print(n.load() is None)"
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "KVLM_NATIVE": "0"},
                          capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr
