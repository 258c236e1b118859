"""The Triton attention over cells (kvlm.kernels.gpu.attention) against its plain torch reference: decode tokens,
prompts over cached cells plus their own, sliding windows, GQA groups, sinks, a softcap, long runs split and added
up, every KV dtype. On this CPU through Triton's interpreter (tests/conftest.py), with a GPU's tolerances."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvlm.kernels.gpu import reference  # noqa: E402
from kvlm.kernels.gpu.attention import attention, plan_tiles  # noqa: E402
from kvlm.memory.view import TokenCells  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": None}


def planes(n_cells: int, n_kv: int, dim: int, kv_dtype: str, generator: torch.Generator) -> tuple[tuple, tuple]:
    """Random K and V planes of `n_cells` cells as the store holds them (q8_0 written through the reference)."""
    result = []
    for _ in range(2):
        values = torch.randn(n_cells, n_kv, dim, generator=generator)
        if kv_dtype == "q8_0":
            plane = (torch.zeros(n_cells, n_kv, dim, dtype=torch.int8),
                     torch.zeros(n_cells, n_kv, dim // 32, dtype=torch.float16))
            reference.kv_write(plane, torch.arange(n_cells), values)
        else:
            plane = (values.to(KV_DTYPES[kv_dtype]), None)
        result.append(tuple(None if t is None else t.to(DEVICE) for t in plane))
    return tuple(result)


def token_cells(runs: list[tuple[list[int], list[tuple[int, int]]]]) -> TokenCells:
    """runs: (the cells of one list, each token's (offset within it, length)) in token order."""
    cells, offsets, lengths = [], [], []
    for run, spans in runs:
        for start, length in spans:
            offsets.append(len(cells) + start)
            lengths.append(length)
        cells.extend(run)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return TokenCells(as_tensor(cells), as_tensor(offsets), as_tensor(lengths))


def scenario(name: str, n_cells: int, generator: torch.Generator) -> TokenCells:
    """Which cells each token reads: scattered cells, in position order."""
    scattered = torch.randperm(n_cells, generator=generator).tolist()
    if name == "decode":  # three sequences of one token each, contexts 7, 40, 1
        return token_cells([(scattered[:7], [(0, 7)]), (scattered[7:47], [(0, 40)]), (scattered[47:48], [(0, 1)])])
    if name == "prompt":  # 20 cached cells and 21 new tokens, causal; then a second sequence's 5-token prompt
        return token_cells([(scattered[:41], [(0, 21 + t) for t in range(20)] + [(0, 41)]),
                            (scattered[41:46], [(0, t + 1) for t in range(5)])])
    if name == "window":  # a sliding window of 8 over a 30-token prompt: each token reads its last 8 positions
        return token_cells([(scattered[:30], [(max(0, t - 7), min(8, t + 1)) for t in range(30)])])
    if name == "long":  # a decode token over 700 cells (split three ways) and one over 90
        return token_cells([(scattered[:700], [(0, 700)]), (scattered[700:790], [(0, 90)])])
    raise ValueError(name)


@pytest.mark.parametrize("case", ["decode", "prompt", "window", "long"])
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("n_head,n_kv", [(4, 4), (8, 2), (6, 1)])
def test_attention_matches_reference(case, kv_dtype, n_head, n_kv):
    generator = torch.Generator().manual_seed(hash((case, kv_dtype, n_head)) % 2**31)
    dim = 64
    cells = scenario(case, 800, generator)
    k, v = planes(800, n_kv, dim, kv_dtype, generator)
    q = torch.randn(len(cells.offsets), n_head, dim, generator=generator).to(DEVICE)
    got = attention(q, k, v, cells, dim ** -0.5)  # (a bf16 cache is read into float32 at once: right here too)
    want = reference.cell_attention(q, k, v, cells, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # a GPU's tf32 products


@pytest.mark.parametrize("case", ["prompt", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sinks_softcap_and_odd_head_size(dtype, case):
    """A head size that is no power of two (80: padded rows), sink logits, a softcap, fp16 queries and cache; within
    one split (each program finishes its rows) and over three (the reduction adds the sinks)."""
    generator = torch.Generator().manual_seed(3)
    n_head, n_kv, dim = 8, 4, 80
    cells = scenario(case, 800, generator)
    k, v = planes(800, n_kv, dim, "f16" if dtype == torch.float16 else "f32", generator)
    q = (3 * torch.randn(len(cells.offsets), n_head, dim, generator=generator)).to(dtype).to(DEVICE)
    sinks = (6 + torch.randn(n_head, generator=generator)).to(DEVICE)  # weighty beside 700 cells too
    got = attention(q, k, v, cells, dim ** -0.5, sinks=sinks, softcap=5.0)
    want = reference.cell_attention(q, k, v, cells, dim ** -0.5, sinks=sinks, softcap=5.0)
    tolerance = 2e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    unsunk = attention(q, k, v, cells, dim ** -0.5, softcap=5.0)
    assert (unsunk - got).abs().max() > 10 * tolerance  # the sinks matter: the test can fail


def test_tiles_group_a_prompt_and_keep_decode_tokens_alone():
    cells = scenario("prompt", 64, torch.Generator().manual_seed(0))
    table, n_tiles, splits = plan_tiles(cells.offsets.cpu().numpy(), cells.lengths.cpu().numpy(), 16, "cpu")
    assert table.tolist() == [[0, 16], [16, 5], [21, 5]] and n_tiles == 3 and splits == 1
    cells = scenario("decode", 64, torch.Generator().manual_seed(0))
    table, n_tiles, _ = plan_tiles(cells.offsets.cpu().numpy(), cells.lengths.cpu().numpy(), 16, "cpu")
    assert table.tolist() == [[0, 1], [1, 1], [2, 1]]
    cells = scenario("long", 800, torch.Generator().manual_seed(0))
    assert plan_tiles(cells.offsets.cpu().numpy(), cells.lengths.cpu().numpy(), 16, "cpu")[2] == 3


def test_a_moved_views_plan_comes_from_its_host_copies():
    """TokenCells moved to a device keep their offsets and lengths on the host: the launch is planned from them,
    never read back ("meta" tensors here: nothing can be read from them), and once per view."""
    cells = scenario("prompt", 64, torch.Generator().manual_seed(0))
    rows, moved = TokenCells(cells.cells.cpu(), cells.offsets.cpu(), cells.lengths.cpu()).to("meta", torch.arange(3))
    assert rows.device.type == "meta" and rows.shape == (3,)
    offsets, lengths = moved.on_host()
    assert offsets.tolist() == cells.offsets.tolist() and lengths.tolist() == cells.lengths.tolist()
    assert plan_tiles(offsets, lengths, 16, "cpu")[0].tolist() == [[0, 16], [16, 5], [21, 5]]
    generator = torch.Generator().manual_seed(1)
    k, v = planes(64, 2, 64, "f32", generator)
    q = torch.randn(len(cells.offsets), 4, 64, generator=generator).to(DEVICE)
    attention(q, k, v, cells, 0.125)
    attention(q, k, v, cells, 0.125)
    assert list(cells.plans) == [("attention", 8)]  # (4 heads over 2 KV heads: groups of 2, 8 tokens a tile)
