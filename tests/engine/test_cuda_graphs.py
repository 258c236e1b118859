"""Decode steps through a CUDA graph's buffers (kvlm.model.cuda_graphs) against the eager step on the same weights:
random float32 models on the Triton backend (unified: Llama, with an f32 and a q8_0 cache; iSWA: Gemma 3, window 8),
batches padded up to their bucket, the attention split a fixed number of ways. The logits agree within float32
rounding (the splits add up in another order) and give the same greedy tokens; a padded lane writes the spare cell
and nothing else, so every cell the step did not write is untouched bit for bit. Steps a graph cannot take (prompt
chunks, recurrent states) run eagerly. On a GPU the graphs are recorded and replayed; without one (Triton's
interpreter, tests/conftest.py) the same buffers run eagerly."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers.kind_files import KIND_FILES  # noqa: E402
from kvlm.core.batch import Batch  # noqa: E402
from kvlm.loader.load import load_model  # noqa: E402
from kvlm.model.cuda_graphs import buckets  # noqa: E402
from kvlm.runtime.context import Context, DecodeStatus  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N_CTX = 512  # past CELLS_PER_SPLIT: a graph's attention splits each run two ways at 4 lanes



def _triton_model(name, tmp_path_factory):
    path = str(KIND_FILES[name](tmp_path_factory.mktemp(name)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVLM_BACKEND", "triton")
        return load_model(path, "float32", quant=None, progress=False, device=DEVICE)


@pytest.fixture(scope="module", params=["unified-llama", "iswa-gemma3"])
def model(request, tmp_path_factory):
    return _triton_model(request.param, tmp_path_factory)


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(3) == [1, 2, 4]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(17) == [1, 2, 4, 8, 16, 32]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def _context(model, cuda_graphs: bool, kv_dtype: str = "f32") -> Context:
    return Context(model, n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=5, kv_dtype=kv_dtype,
                   cuda_graphs=cuda_graphs)


def _decode(ctx: Context, batch: Batch) -> torch.Tensor:
    assert ctx.decode(batch) == DecodeStatus.OK, ctx.last_error
    n = sum(batch.logits) if batch.logits else 1
    return torch.stack([ctx.get_logits_ith(i).clone() for i in range(n)])


def _prompts(vocab: int) -> Batch:
    """Three sequences' prompts of 9, 5 and 12 tokens, their last tokens' logits wanted."""
    g = torch.Generator().manual_seed(3)
    lengths = {1: 9, 2: 5, 3: 12}
    tokens, pos, seqs, logits = [], [], [], []
    for seq, n in lengths.items():
        tokens += torch.randint(1, vocab, (n,), generator=g).tolist()
        pos += range(n)
        seqs += [seq] * n
        logits += [False] * (n - 1) + [True]
    return Batch(tokens=tokens, pos=pos, seq_ids=seqs, logits=logits)


def _planes(ctx: Context) -> list[list[torch.Tensor]]:
    """Each pool's stored K and V tensors (a q8_0 plane's quants and scales), copied."""
    return [[t.clone() for plane in (pool.store.k, pool.store.v) for t in plane.stored() if t is not None]
            for pool in ctx.memory.pools]


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_graph_steps_match_eager_steps(model, kv_dtype):
    if kv_dtype == "q8_0" and model.config.sliding_window:
        pytest.skip("the q8_0 planes are the same in both pools: checked on the unified memory")
    eager, graphs = _context(model, False, kv_dtype), _context(model, True, kv_dtype)
    assert eager.decode_graphs is None and graphs.decode_graphs is not None
    prompts = _prompts(model.config.vocab_size)
    want, got = _decode(eager, prompts), _decode(graphs, prompts)
    assert graphs.decode_graphs.graphs == {}  # prompt chunks run eagerly
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    positions = {1: 9, 2: 5, 3: 12}
    for step, seqs in enumerate([[1, 2, 3], [2], [3, 1]]):
        tokens = [(97 * s + 13 * step) % model.config.vocab_size for s in seqs]
        batch = Batch(tokens=tokens, pos=[positions[s] for s in seqs], seq_ids=seqs, logits=[True] * len(seqs))
        _clear_spare_rows(graphs)
        before = _planes(graphs)
        want, got = _decode(eager, batch), _decode(graphs, batch)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        _assert_only_written_rows_changed(graphs, before, len(seqs))
        for s in seqs:
            positions[s] += 1
    assert sorted(graphs.decode_graphs.graphs) == [1, 2, 4]
    for pool, old_planes, new_planes in zip(eager.memory.pools, _planes(eager), _planes(graphs)):  # real cells agree
        n = pool.store.n_cells
        for a, b in zip(old_planes, new_planes):
            torch.testing.assert_close(b[:, :n].float(), a[:, :n].float(), atol=1e-5, rtol=1e-5)


def _clear_spare_rows(ctx: Context) -> None:
    """A value no step writes in the spare rows (which padded lanes write the same values to at every step, zeros
    for a model whose padding token embeds to zeros), to see them written."""
    for pool in ctx.memory.pools:
        for plane in (pool.store.k, pool.store.v):
            for t in plane.stored():
                if t is not None:
                    t[:, pool.store.spare_cell] = 123


def _assert_only_written_rows_changed(ctx: Context, before: list[list[torch.Tensor]], n_tokens: int) -> None:
    """Every row but those the step's tokens took and the spare one is as it was, bit for bit; the spare row
    changed where a lane was padded."""
    for pool, old_planes, new_planes in zip(ctx.memory.pools, before, _planes(ctx)):
        spare = pool.store.spare_cell
        written = set(ctx.decode_graphs.lanes[id(pool.store)].rows[:n_tokens].tolist())
        assert spare not in written
        keep = [c for c in range(pool.store.n_cells) if c not in written]
        for old, new in zip(old_planes, new_planes):
            assert torch.equal(new[:, keep], old[:, keep])
            assert torch.equal(new[:, spare], old[:, spare]) == (n_tokens in (1, 2, 4))


def test_steps_a_graph_cannot_take_run_eagerly(tmp_path_factory):
    """A recurrent memory's decode steps (its states are not K/V rows) and a two-token prompt (one output of two
    tokens) never reach a graph, and compute what the eager context computes."""
    mamba = _triton_model("recurrent-mamba2", tmp_path_factory)
    eager, graphs = _context(mamba, False), _context(mamba, True)
    for batch in (Batch.for_sequence([1, 5], seq_id=1), Batch(tokens=[7], pos=[2], seq_ids=[1], logits=[True])):
        torch.testing.assert_close(_decode(graphs, batch), _decode(eager, batch), atol=0, rtol=0)
    assert graphs.decode_graphs.graphs == {}


def test_a_later_context_on_the_same_model_leaves_the_graphs_right(model):
    """A second Context fits the decoder to its length anew (new RoPE objects): the first one's graph buffers
    still get the rotations."""
    first = _context(model, True)
    prompt = Batch.for_sequence([5, 6, 7], seq_id=1)
    _decode(first, prompt)
    Context(model, n_ctx=N_CTX, n_batch=8, n_ubatch=8, n_seq_max=2)
    eager = _context(model, False)
    _decode(eager, prompt)
    step = Batch(tokens=[8], pos=[3], seq_ids=[1], logits=[True])
    torch.testing.assert_close(_decode(first, step), _decode(eager, step), atol=1e-5, rtol=1e-5)
    assert sorted(first.decode_graphs.graphs) == [1]
