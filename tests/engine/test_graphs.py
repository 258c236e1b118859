"""The decode and prefill graphs compute what the eager path computes, against transformers and each other.

Most tests trace the graphs with torch.compile's "eager" backend: the same captured graphs, run without
inductor, so they check what the graphs hold (gathered rows, own K/V, masks, padding to a bucket) in seconds.
One test compiles them with inductor on a tiny model and compares with the eager path.
"""
from __future__ import annotations

import pytest
import torch

from helpers.family_factory import SPECS, random_model, save_model
from helpers.models import decode_ok, max_diff, reference_logits, token_ids
from kvlm import Batch, Context, load_model
from kvlm.model.graphs import PREFILL_MIN_TOKENS, StepGraphs, check_compiler

TOLERANCE = 1e-4
PROMPTS = (70, 23, 9)  # prompts for the prefill graph, each its own batch
UBATCH = 32  # the 70-token prompt as chunks of 32 (none cached before it), 32 (32 cached) and 6 (eager)
STEPS = 5              # then decode steps of all three at once: the decode graph at bucket 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama-llama3", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    reference = random_model(SPECS[request.param])
    path = save_model(reference, SPECS[request.param], "gguf", tmp_path_factory.mktemp(request.param))
    return reference, path


class EagerCalls:
    """Counts the decoder's eager forwards, to know which micro-batches the graphs took."""

    def __init__(self, model, monkeypatch) -> None:
        self.n = 0
        forward = model.decoder.forward

        def counted(*args, **kwargs):
            self.n += 1
            return forward(*args, **kwargs)

        monkeypatch.setattr(model.decoder, "forward", counted)


def prefill_and_decode(model, prompts: list[list[int]], continuations: list[list[int]], kv_dtype: str = "f32"):
    """Each prompt as its own batch, then one batch per step with the next token of every sequence.

    Returns per sequence the logits of its prompt's last token and of each fed continuation token."""
    ctx = Context(model, n_ctx=256, n_ubatch=UBATCH, n_seq_max=len(prompts), kv_dtype=kv_dtype)
    logits = [[] for _ in prompts]
    for seq, ids in enumerate(prompts):
        decode_ok(ctx, Batch.for_sequence(ids, seq_id=seq))
        logits[seq].append(ctx.get_logits_ith(-1).clone())
    for step in range(len(continuations[0])):
        tokens = [c[step] for c in continuations]
        positions = [len(p) + step for p in prompts]
        seq_ids = list(range(len(prompts)))
        decode_ok(ctx, Batch(tokens=tokens, pos=positions, seq_ids=seq_ids, logits=[True] * len(tokens)))
        for seq in range(len(prompts)):
            logits[seq].append(ctx.get_logits_ith(seq).clone())
    return [torch.stack(rows) for rows in logits]


def sequences(vocab_size: int):
    prompts = [token_ids(vocab_size, n, seed=n) for n in PROMPTS]
    continuations = [token_ids(vocab_size, STEPS, seed=100 + s) for s in range(len(PROMPTS))]
    return prompts, continuations


def test_traced_graphs_match_transformers(family, monkeypatch):
    reference, path = family
    model = load_model(str(path), "float32")
    model.graphs = StepGraphs(model.decoder, backend="eager")
    eager = EagerCalls(model, monkeypatch)
    prompts, continuations = sequences(reference.config.vocab_size)
    ours = prefill_and_decode(model, prompts, continuations)
    assert eager.n == 1  # every chunk but the 6-token one, and every step, went through a graph
    for prompt, more, logits in zip(prompts, continuations, ours):
        expected = reference_logits(reference, prompt + more)[len(prompt) - 1:]
        assert max_diff(logits, expected) <= TOLERANCE


def test_batches_without_a_graph_run_eagerly_and_agree(family, monkeypatch):
    """Several prompts in one batch, short chunks and a q8_0 cache take the eager path, with the same logits."""
    reference, path = family
    model = load_model(str(path), "float32")
    plain = prefill_and_decode(model, *sequences(reference.config.vocab_size), kv_dtype="q8_0")
    model.graphs = StepGraphs(model.decoder, backend="eager")
    eager = EagerCalls(model, monkeypatch)
    traced = prefill_and_decode(model, *sequences(reference.config.vocab_size), kv_dtype="q8_0")
    assert eager.n == len(PROMPTS) + 2 + STEPS  # the 70-token prompt in three chunks
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))

    eager.n = 0
    ctx = Context(model, n_ctx=64, n_seq_max=2)
    short = token_ids(reference.config.vocab_size, PREFILL_MIN_TOKENS - 1)
    decode_ok(ctx, Batch(tokens=short * 2, seq_ids=[0] * len(short) + [1] * len(short)))  # two sequences at once
    decode_ok(ctx, Batch.for_sequence(short[:3], seq_id=0))  # a chunk too short for the prefill graph
    assert eager.n == 2


def test_default_settings_through_graphs_match_eager(family):
    """The fast defaults (bf16, quantized matrices) round the same way in and out of the graphs, up to the
    order of their sums: within bf16's noise, and the same greedy choices."""
    reference, path = family
    model = load_model(str(path))
    prompts, continuations = sequences(reference.config.vocab_size)
    eager = prefill_and_decode(model, prompts, continuations, kv_dtype="bf16")
    model.graphs = StepGraphs(model.decoder, backend="eager")
    traced = prefill_and_decode(model, prompts, continuations, kv_dtype="bf16")
    for a, b in zip(eager, traced):
        assert max_diff(a, b) <= 0.05 * a.abs().max().item()


def test_a_failed_graph_step_leaves_the_cache_as_it_was(family, monkeypatch):
    reference, path = family
    model = load_model(str(path), "float32")
    model.graphs = StepGraphs(model.decoder, backend="eager")
    prompts, continuations = sequences(reference.config.vocab_size)
    ctx = Context(model, n_ctx=256, n_seq_max=len(prompts))
    for seq, ids in enumerate(prompts):
        decode_ok(ctx, Batch.for_sequence(ids, seq_id=seq))
    before = (ctx.memory.n_used, ctx.memory.store.k.data.clone(), ctx.memory.store.v.data.clone())

    def broken(*args):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(model.graphs, "_decode", broken)
    status = ctx.decode(Batch(tokens=[c[0] for c in continuations], pos=[len(p) for p in prompts],
                              seq_ids=[0, 1, 2], logits=[True] * 3))
    assert status.name == "COMPUTE_FAILED" and "injected failure" in ctx.last_error
    assert ctx.memory.n_used == before[0]
    assert torch.equal(ctx.memory.store.k.data, before[1]) and torch.equal(ctx.memory.store.v.data, before[2])


def test_compiled_graphs_equal_the_eager_path(tmp_path):
    """inductor's graphs on a tiny model: every logit within float32 tolerance of the eager path's."""
    try:
        check_compiler()
    except RuntimeError as error:
        pytest.skip(str(error))
    spec = SPECS["llama-linear"]
    reference = random_model(spec)
    model = load_model(str(save_model(reference, spec, "gguf", tmp_path)), "float32")
    prompts, continuations = sequences(reference.config.vocab_size)
    eager = prefill_and_decode(model, prompts, continuations)
    model.graphs = StepGraphs(model.decoder)
    compiled = prefill_and_decode(model, prompts, continuations)
    for a, b in zip(eager, compiled):
        assert max_diff(a, b) <= TOLERANCE
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_compile_with_batch_invariance_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="compile and batch_invariant exclude each other"):
        load_model(str(tmp_path / "not-read.gguf"), "float32", batch_invariant=True, compile=True)


def test_compile_without_a_cpp_compiler_is_refused_before_loading(tmp_path, monkeypatch):
    from torch._inductor import cpp_builder, exc

    def no_compiler():
        raise exc.InvalidCxxCompiler

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        load_model(str(tmp_path / "not-read.gguf"), compile=True)
