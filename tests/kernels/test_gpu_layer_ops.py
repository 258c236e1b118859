"""The Triton KV write, RMSNorm and RoPE (kvlm.kernels.gpu) against their plain torch references, on this CPU through
Triton's interpreter (tests/conftest.py). The q8_0 write must give the CPU store's bytes exactly."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvlm.core.rope import Rope, RopeScaling  # noqa: E402
from kvlm.kernels.gpu import reference  # noqa: E402
from kvlm.kernels.gpu.kv_write import kv_write  # noqa: E402
from kvlm.kernels.gpu.layer_ops import rms_norm, rope_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter gets bfloat16 wrong (triton#11584): its kernels are checked in bf16 on a GPU only
BF16 = pytest.param("bf16", marks=pytest.mark.skipif(DEVICE == "cpu", reason="bf16 is wrong in Triton's interpreter"))


def empty_plane(kv_dtype: str, n_cells: int, n_kv: int, dim: int) -> tuple:
    if kv_dtype == "q8_0":
        return (torch.zeros(n_cells, n_kv, dim, dtype=torch.int8, device=DEVICE),
                torch.zeros(n_cells, n_kv, dim // 32, dtype=torch.float16, device=DEVICE))
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kv_dtype]
    return torch.zeros(n_cells, n_kv, dim, dtype=dtype, device=DEVICE), None


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", BF16, "q8_0"])
@pytest.mark.parametrize("dim", [64, 96])
def test_kv_write_gives_the_stores_bytes(kv_dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    values = torch.randn(9, 2, dim, generator=generator)
    halves = torch.tensor([127.0] + [(k + 0.5) * (-1) ** k for k in range(31)])  # scale 1/64: quotients at halves
    values[0, 0, :32] = halves / 64  # (rounded half to even, as torch.round: half away from zero differs)
    values[1, 1, :32] = 0  # an all-zero block: scale 0, quants 0
    rows = torch.randperm(20, generator=generator)[:9]
    got, want = empty_plane(kv_dtype, 20, 2, dim), empty_plane(kv_dtype, 20, 2, dim)
    kv_write(got, rows.to(DEVICE), values.to(DEVICE))
    reference.kv_write(want, rows.to(DEVICE), values.to(DEVICE))
    for got_part, want_part in zip(got, want):
        if want_part is not None:
            assert torch.equal(got_part.cpu(), want_part.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 200, generator=generator).to(dtype).to(DEVICE)
    residual = torch.randn(5, 200, generator=generator).to(dtype).to(DEVICE) if with_residual else None
    weight = torch.randn(200, generator=generator).to(dtype).to(DEVICE)
    got = rms_norm(x, weight, 1e-6, residual)
    want = reference.rms_norm(x, weight, 1e-6, residual)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[0], want[0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)


@pytest.mark.parametrize("rotated", [64, 16])
def test_rope_whole_and_partial_heads(rotated):
    """kvlm's own cos/sin tables (kvlm.core.rope) for positions 0..6, over whole heads and a quarter of each."""
    generator = torch.Generator().manual_seed(rotated)
    positions = torch.tensor([0, 1, 2, 5, 100, 101, 4095])
    cos, sin = (t.to(DEVICE) for t in Rope(RopeScaling(theta=10_000.0), rotated).cos_sin(positions, torch.float32))
    qk = torch.randn(7, 6, 64, generator=generator).to(DEVICE)
    want = reference.rope(qk, cos, sin)
    got = rope_(qk.clone(), cos, sin)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., rotated:], qk[..., rotated:])
