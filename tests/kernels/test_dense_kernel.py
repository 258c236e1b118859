"""The native dense product (kvlm/kernels/csrc/dense.h) against a float64 product, for every weight and activation
dtype, in this CPU's build and in plain C++ (no AVX2): close to the exact result, and each output row the same bits
whatever other rows share the call and whatever the number of threads. Every build the `kernels` fixture makes
(tests/kernels/conftest.py: this CPU's, AVX2, plain C++ with one value at a time, AVX-512 where it runs)."""
from __future__ import annotations

import ctypes

import pytest
import torch


WEIGHT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATION_DTYPES = [torch.float32, torch.bfloat16]
# (out, in): in never a multiple of 8 (333: two chains of FMAs, the second partial), out with rows after its whole
# panels of 8 (and one with fewer than 8 rows)
SHAPES = [(77, 203), (5, 33), (130, 333), (16, 1)]
ROW_COUNTS = [*range(1, 10), 13, 31, 70, 300]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def random_weight(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)


def random_x(m: int, in_features: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_close_to_exact(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Within 1e-5 of each row's scale (the largest sum of |x| |w| over its outputs) of the float64 product, plus
    one rounding to bfloat16 where y is bfloat16."""
    exact = x.double() @ weight.double().T
    scale = (x.double().abs() @ weight.double().abs().T).amax(dim=1, keepdim=True)
    allowed = 1e-5 * scale + (exact.abs() * 2.0 ** -8 if y.dtype == torch.bfloat16 else 0.0)
    error = (y.double() - exact).abs()
    assert (error <= allowed).all(), f"worst error {(error / allowed).max().item():.2f} times the allowed"


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", ACTIVATION_DTYPES, ids=str)
def test_product_matches_float64(kernels, weight_dtype, x_dtype):
    for out_features, in_features in SHAPES:
        weight = random_weight(out_features, in_features, weight_dtype)
        product = kernels.dense(weight)
        assert (product.out_features, product.in_features) == (out_features, in_features)
        assert product.weight.dtype == weight_dtype and product.nbytes == weight.numel() * weight.element_size()
        for m in ROW_COUNTS:
            x = random_x(m, in_features, x_dtype)
            y = product(x)
            assert y.dtype == x_dtype and y.shape == (m, out_features)
            assert_close_to_exact(y, x, weight)
            sums = product(x, torch.float32)  # float32 out whatever x's dtype (the logits): the sums unrounded
            assert sums.dtype == torch.float32 and torch.equal(sums, product(x.float()))
            assert torch.equal(product(x, torch.bfloat16), product(x.float()).bfloat16())


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", ACTIVATION_DTYPES, ids=str)
def test_rows_do_not_depend_on_the_batch_or_threads(kernels, weight_dtype, x_dtype, restore_threads):
    weight = random_weight(93, 333, weight_dtype)  # 11 panels and 5 rows after them, shared by 1 or 2 threads
    product = kernels.dense(weight)
    x = random_x(300, 333, x_dtype)
    torch.set_num_threads(1)
    alone = torch.cat([product(x[r:r + 1]) for r in range(x.shape[0])])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in [*range(2, 71), 128, 300]:
            assert torch.equal(product(x[:m]), alone[:m]), f"{m} rows, {threads} threads"
        shifted = product(x[7:])  # every row in another place of its register block
        assert torch.equal(shifted, alone[7:]), f"rows 7.. of 300, {threads} threads"


def test_no_rows(kernels):
    product = kernels.dense(random_weight(9, 20, torch.float32))
    assert product(torch.empty(0, 20)).shape == (0, 9)


def test_bad_shapes_are_refused(kernels):
    product = kernels.dense(random_weight(12, 40, torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[m, 40\].*\[12, 40\].*\[3, 41\]"):
        product(torch.zeros(3, 41))
    with pytest.raises(ValueError, match=r"\[2, 3, 40\]"):
        product(torch.zeros(2, 3, 40))
    with pytest.raises(ValueError, match="torch.float16"):
        product(torch.zeros(3, 40, dtype=torch.float16))
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        product(torch.zeros(3, 40), torch.float16)
    with pytest.raises(ValueError, match=r"torch.int32 \[12, 40\]"):
        kernels.dense(torch.zeros(12, 40, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[480\]"):
        kernels.dense(torch.zeros(480))


def test_c_api_refuses_bad_arguments(kernels):
    """What the C side says about arguments the Python class never passes: BAD_SHAPE (2)."""
    lib = kernels._lib
    weight, y = torch.zeros(8, 4), torch.zeros(1, 8)
    x = ctypes.c_void_p(torch.zeros(1, 4).data_ptr())
    i64 = ctypes.c_int64
    assert lib.kvlm_dense_pack(ctypes.c_void_p(weight.data_ptr()), 7, i64(8), i64(4),
                               ctypes.c_void_p(y.data_ptr()), 1) == 2  # no dtype 7
    assert lib.kvlm_dense_pack(ctypes.c_void_p(weight.data_ptr()), 0, i64(8), i64(0),
                               ctypes.c_void_p(y.data_ptr()), 1) == 2
    for m, k, n, dtype in [(-1, 4, 8, 0), (1, 0, 8, 0), (1, 4, 0, 0), (1, 4, 8, 3)]:
        assert lib.kvlm_dense_matmul(x, 0, i64(m), i64(k), ctypes.c_void_p(weight.data_ptr()), dtype, i64(n),
                                     ctypes.c_void_p(y.data_ptr()), 0, 1) == 2, (m, k, n, dtype)
