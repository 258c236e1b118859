"""Batch invariance's layouts: every prompt token's logits with the prompt reaching the cache whole in one micro-batch
(the reference), cut into micro-batches of 1, 7 and 64 tokens, its first half computed by another sequence and
shared (the prefix cache), beside another sequence's prompt, in runs of guesses beside another sequence's decode
token, one token per step; and the check that each layout gives the same bits, for test_batch_invariance and
test_batch_invariance_kinds."""
from __future__ import annotations

import torch

from helpers.models import decode_ok
from kvlm import Batch, Context

KV_DTYPES = ["f32", "f16", "bf16", "q8_0"]
LAYOUTS = ["ubatch_1", "ubatch_7", "ubatch_64", "cached_prefix", "beside_others", "guesses", "decode"]
RUN = 5  # a last token and its 4 guesses


def all_logits(tokens: list[int], seq_id: int, start: int) -> Batch:
    return Batch(tokens=tokens, pos=list(range(start, start + len(tokens))), seq_ids=[seq_id] * len(tokens),
                 logits=[True] * len(tokens))


def rows_of(ctx: Context, batch: Batch, rows) -> list[torch.Tensor]:
    decode_ok(ctx, batch)
    return [ctx.get_logits_ith(i).clone() for i in rows]


def prompt_logits(model, kv_dtype: str, prompt: list[int], other: list[int], layout: str | None = None) -> torch.Tensor:
    """[len(prompt), vocab]: every prompt token's logits, the prompt (sequence 0) reaching the cache as `layout` says
    (None: whole, in one micro-batch). `other`: another sequence's tokens, for the layouts that have neighbours."""
    n_ubatch = int(layout.split("_")[1]) if layout and layout.startswith("ubatch") else 256
    ctx = Context(model, n_ctx=256, n_batch=256, n_ubatch=n_ubatch, n_seq_max=4, kv_dtype=kv_dtype)
    half, n = len(prompt) // 2, len(prompt)
    if layout is None or layout.startswith("ubatch"):
        return torch.stack(rows_of(ctx, all_logits(prompt, 0, 0), range(n)))
    if layout == "cached_prefix":  # the first half computed by sequence 2, then lent to sequence 0
        first = rows_of(ctx, all_logits(prompt[:half], 2, 0), range(half))
        ctx.memory.seq_cp(2, 0, -1, -1)
        return torch.stack(first + rows_of(ctx, all_logits(prompt[half:], 0, half), range(n - half)))
    decode_ok(ctx, Batch.for_sequence(other, seq_id=1))  # a neighbour in the cache
    if layout == "beside_others":
        batch = Batch(tokens=other + prompt, pos=list(range(len(other))) + list(range(n)),
                      seq_ids=[3] * len(other) + [0] * n, logits=[False] * len(other) + [True] * n)
        return torch.stack(rows_of(ctx, batch, range(n)))  # the outputs: the prompt's tokens alone
    rows, done = [], 0
    if layout == "guesses":
        rows, done = rows_of(ctx, all_logits(prompt[:half], 0, 0), range(half)), half
    step = RUN if layout == "guesses" else 1
    for i, at in enumerate(range(done, n, step)):  # each run beside sequence 1's next decode token
        run = prompt[at:at + step]
        batch = Batch(tokens=[other[i % len(other)]] + run, pos=[len(other) + i] + list(range(at, at + len(run))),
                      seq_ids=[1] + [0] * len(run), logits=[True] * (1 + len(run)))
        rows += rows_of(ctx, batch, range(1, 1 + len(run)))
    return torch.stack(rows)


def assert_every_layout_equal(model, kv_dtype: str, prompt: list[int], other: list[int], layouts=LAYOUTS) -> None:
    whole = prompt_logits(model, kv_dtype, prompt, other)
    for layout in layouts:
        got = prompt_logits(model, kv_dtype, prompt, other, layout)
        assert torch.equal(got, whole), f"{layout}: max diff {(got - whole).abs().max().item():.3g}"
