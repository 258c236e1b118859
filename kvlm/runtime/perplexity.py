"""Perplexity of a model over a text, computed exactly as llama.cpp's `llama-perplexity` computes it.

llama.cpp's method (tools/perplexity/perplexity.cpp, `perplexity()`):

- tokenize the whole text once, adding BOS if the model asks for it (a model that adds EOS is refused);
- refuse a text shorter than 2 x n_ctx tokens; cut it into n_tokens // n_ctx chunks of n_ctx tokens (the tail is
  dropped), or the first `n_chunks` of them;
- run each chunk alone on an empty cache at positions 0..n_ctx-1, its first token replaced by BOS when the model
  adds BOS, with logits for the positions from `first = n_ctx // 2` on;
- score the second half only: the logits at positions first..n_ctx-2 predict the chunk's tokens first+1..n_ctx-1
  (n_ctx - first - 1 tokens a chunk), each token's NLL = log(sum exp(logits - max)) - (logit[token] - max);
- after each chunk print the running PPL = exp(mean NLL so far); at the end PPL = exp(mean NLL) and its standard
  error ppl * sqrt((mean(NLL^2) - mean(NLL)^2) / (count - 1)).

The model-independent steps (`plan_chunks`, `score_chunk`, `Accumulator`) also score another engine's logits, as
bench/quality.py does with llama.cpp's.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from kvlm.core.batch import Batch
from kvlm.runtime.context import Context, DecodeStatus
from kvlm.core.errors import KvlmError
from kvlm.loader.load import Model
from kvlm.memory.kv_store import AUTO, resolve_kv_dtype
from kvlm.text.tokenizer import Tokenizer

N_UBATCH = 512  # llama.cpp's default micro-batch

log = logging.getLogger("kvlm")


class PerplexityError(KvlmError, ValueError):
    """The text, the context size or the chunk count cannot give a perplexity; the message names the value."""


@dataclass(frozen=True)
class ChunkPlan:
    """What one run over a text evaluates: the chunks' tokens (BOS already in place) and where scoring starts."""

    n_ctx: int
    n_tokens: int                # tokens of the whole text, BOS included
    chunks: list[list[int]]      # n_ctx tokens each, as the model sees them
    targets: list[list[int]]     # per chunk, the scored tokens: the original tokens first+1 .. n_ctx-1

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - self.first - 1


@dataclass(frozen=True)
class ChunkScore:
    """One chunk's scored tokens: their NLL (float64) and the model's top-1 token at each of those positions."""

    nll: np.ndarray
    top1: np.ndarray


@dataclass
class ChunkReport:
    """Progress after a chunk: its number (1-based), of how many, and the running PPL over every chunk so far."""

    index: int
    n_chunks: int
    running_ppl: float
    score: ChunkScore


@dataclass
class PerplexityResult:
    ppl: float
    ppl_stderr: float | None     # None when the NLL variance is not positive (llama.cpp prints an error then)
    n_ctx: int
    n_chunks: int
    n_tokens: int
    running: list[float]         # the running PPL after each chunk, as llama.cpp prints [1]..,[2]..
    nll: np.ndarray              # every scored token's NLL, in text order
    top1: np.ndarray             # the model's top-1 token at each scored position
    targets: np.ndarray          # the scored tokens themselves

    @property
    def n_scored(self) -> int:
        return len(self.nll)

    @property
    def top1_accuracy(self) -> float:
        """Share of scored positions where the top-1 prediction is the text's next token."""
        return float(np.mean(self.top1 == self.targets))

    def to_json(self) -> dict:
        return {"ppl": self.ppl, "ppl_stderr": self.ppl_stderr, "n_ctx": self.n_ctx, "n_chunks": self.n_chunks,
                "n_tokens": self.n_tokens, "n_scored": self.n_scored, "top1_accuracy": self.top1_accuracy,
                "running_ppl": self.running}


def top1_agreement(a: PerplexityResult, b: PerplexityResult) -> float:
    """Share of scored positions where two runs over the same plan predict the same top-1 token."""
    if len(a.top1) != len(b.top1) or not np.array_equal(a.targets, b.targets):
        raise ValueError(f"the runs scored different tokens ({len(a.top1)} vs {len(b.top1)}): compare runs over "
                         "the same text, n_ctx and chunk count")
    return float(np.mean(a.top1 == b.top1))


# --- tokens and chunks ----------------------------------------------------------------------------------------------

def boundary_tokens(tokenizer: Tokenizer) -> tuple[bool, bool]:
    """Whether encoding adds BOS in front and EOS at the end (llama_vocab_get_add_bos / _add_eos)."""
    full, plain = tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False)
    add_bos = tokenizer.bos_id is not None and full[:1] == [tokenizer.bos_id] and plain[:1] != [tokenizer.bos_id]
    add_eos = tokenizer.eos_id is not None and full[-1:] == [tokenizer.eos_id] and plain[-1:] != [tokenizer.eos_id]
    return add_bos, add_eos


def tokenize(tokenizer: Tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's tokens with the model's BOS, and the BOS id each chunk starts with (None if the model adds none)."""
    add_bos, add_eos = boundary_tokens(tokenizer)
    if add_eos:
        raise PerplexityError("this model's tokenizer adds EOS after every text; llama.cpp's perplexity refuses "
                              "such models (it asserts !add_eos), and so does kvlm")
    return tokenizer.encode(text), tokenizer.bos_id if add_bos else None


def plan_chunks(tokens: list[int], n_ctx: int, n_chunks: int | None = None, bos_id: int | None = None) -> ChunkPlan:
    """Cut `tokens` into chunks as llama.cpp does; refuse what it refuses, with the value and the limit named."""
    check_n_ctx(n_ctx)
    if len(tokens) < 2 * n_ctx:
        raise PerplexityError(f"the text tokenizes to only {len(tokens)} tokens; perplexity with a context of "
                              f"{n_ctx} needs at least 2 x n_ctx = {2 * n_ctx} tokens")
    check_chunks(n_chunks)
    count = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    first = n_ctx // 2
    originals = [tokens[i * n_ctx: (i + 1) * n_ctx] for i in range(count)]
    chunks = [[bos_id, *chunk[1:]] if bos_id is not None else list(chunk) for chunk in originals]
    return ChunkPlan(n_ctx, len(tokens), chunks, [chunk[first + 1:] for chunk in originals])


def check_n_ctx(n_ctx: object) -> None:
    """n_ctx must leave at least one scored token a chunk: n_ctx - n_ctx // 2 - 1 >= 1, so n_ctx >= 3."""
    if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 3:
        raise PerplexityError(f"n_ctx must be an integer of at least 3 (a chunk scores its last "
                              f"n_ctx - n_ctx/2 - 1 tokens), got {n_ctx!r}")


def check_chunks(n_chunks: object) -> None:
    if n_chunks is not None and (not isinstance(n_chunks, int) or isinstance(n_chunks, bool) or n_chunks < 1):
        raise PerplexityError(f"the number of chunks must be a positive integer (or None for all), got {n_chunks!r}")


# --- scoring --------------------------------------------------------------------------------------------------------

def score_chunk(logits: torch.Tensor, targets: list[int]) -> ChunkScore:
    """NLL and top-1 of each scored token from the logits at positions first.. (at least len(targets) rows).

    As llama.cpp's log_softmax: exp of (logit - max) in float32, summed in float64.
    """
    x = logits[: len(targets)].float()
    target = torch.tensor(targets, dtype=torch.long)
    best = x.max(dim=-1).values
    sum_exp = (x - best[:, None]).exp().double().sum(dim=-1)
    picked = (x.gather(1, target[:, None]).squeeze(1) - best).double()
    return ChunkScore(nll=(sum_exp.log() - picked).numpy(), top1=x.argmax(dim=-1).numpy())


@dataclass
class Accumulator:
    """Running sums of NLL and NLL^2 over scored tokens, as llama.cpp keeps them."""

    scores: list[ChunkScore] = field(default_factory=list)
    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, score: ChunkScore) -> float:
        """Add a chunk's scores; return the running PPL."""
        self.scores.append(score)
        self.nll += float(score.nll.sum())
        self.nll2 += float(np.square(score.nll).sum())
        self.count += len(score.nll)
        return math.exp(self.nll / self.count)

    def result(self, plan: ChunkPlan, running: list[float]) -> PerplexityResult:
        mean, mean2 = self.nll / self.count, self.nll2 / self.count
        ppl, variance = math.exp(mean), mean2 - mean * mean
        stderr = ppl * math.sqrt(variance / (self.count - 1)) if variance > 0 and self.count > 1 else None
        return PerplexityResult(
            ppl=ppl, ppl_stderr=stderr, n_ctx=plan.n_ctx, n_chunks=len(plan.chunks), n_tokens=plan.n_tokens,
            running=running, nll=np.concatenate([s.nll for s in self.scores]),
            top1=np.concatenate([s.top1 for s in self.scores]),
            targets=np.array([t for targets in plan.targets for t in targets], dtype=np.int64))


def iter_evaluate(plan: ChunkPlan, chunk_logits: Callable[[list[int], int], torch.Tensor]
                  ) -> Iterator[ChunkReport | PerplexityResult]:
    """Score the chunks of `plan` one by one, yielding a ChunkReport after each and the PerplexityResult last.

    `chunk_logits(tokens, first)` returns the logits of the chunk's positions first.. (one row each).
    """
    totals, running = Accumulator(), []
    for index, (chunk, targets) in enumerate(zip(plan.chunks, plan.targets), start=1):
        score = score_chunk(chunk_logits(chunk, plan.first), targets)
        running.append(totals.add(score))
        yield ChunkReport(index, len(plan.chunks), running[-1], score)
    yield totals.result(plan, running)


def evaluate(plan: ChunkPlan, chunk_logits: Callable[[list[int], int], torch.Tensor],
             on_chunk: Callable[[ChunkReport], None] | None = None) -> PerplexityResult:
    """iter_evaluate to the end; `on_chunk` sees each ChunkReport."""
    for item in iter_evaluate(plan, chunk_logits):
        if isinstance(item, PerplexityResult):
            return item
        if on_chunk is not None:
            on_chunk(item)
    raise AssertionError("iter_evaluate always ends with a result")


# --- kvlm -----------------------------------------------------------------------------------------------------------

def kvlm_chunk_logits(model: Model, n_ctx: int, kv_dtype: str = AUTO) -> Callable[[list[int], int], torch.Tensor]:
    """A chunk runner over one kvlm Context: one sequence, cleared before each chunk, logits from `first` on."""
    if n_ctx > model.config.n_ctx_train:  # llama.cpp warns the same way and goes on
        log.warning("the model was trained on only %d context tokens (%d specified)", model.config.n_ctx_train, n_ctx)
    context = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, N_UBATCH), n_seq_max=1,
                      kv_dtype=resolve_kv_dtype(kv_dtype, model.decoder.dtype, model.decoder.quantized))

    def run(tokens: list[int], first: int) -> torch.Tensor:
        context.memory.clear()
        batch = Batch(tokens=tokens, pos=list(range(len(tokens))), seq_ids=[0] * len(tokens),
                      logits=[p >= first for p in range(len(tokens))])
        status = context.decode(batch)
        if status != DecodeStatus.OK:
            raise KvlmError(f"decoding a chunk of {len(tokens)} tokens failed ({status.name}): {context.last_error}")
        return torch.stack([context.get_logits_ith(k) for k in range(len(tokens) - first)])

    return run


def iter_perplexity(model: Model, text: str, n_ctx: int = 512, n_chunks: int | None = None,
                    kv_dtype: str = AUTO) -> Iterator[ChunkReport | PerplexityResult]:
    """llama-perplexity over `text` with a kvlm model: a ChunkReport after each chunk, the PerplexityResult last.

    The text, n_ctx and the chunk count are checked before the first chunk runs (and before the KV cache exists).
    """
    plan = plan_for(model.tokenizer, text, n_ctx, n_chunks)
    return iter_evaluate(plan, kvlm_chunk_logits(model, n_ctx, kv_dtype))


def perplexity(model: Model, text: str, n_ctx: int = 512, n_chunks: int | None = None, kv_dtype: str = AUTO,
               on_chunk: Callable[[ChunkReport], None] | None = None) -> PerplexityResult:
    """iter_perplexity to the end; `on_chunk` sees the running PPL after each chunk."""
    plan = plan_for(model.tokenizer, text, n_ctx, n_chunks)
    return evaluate(plan, kvlm_chunk_logits(model, n_ctx, kv_dtype), on_chunk)


def plan_for(tokenizer: Tokenizer, text: str, n_ctx: int, n_chunks: int | None = None) -> ChunkPlan:
    """Tokenize `text` as llama.cpp does and cut it into chunks (n_ctx is checked before tokenizing)."""
    check_n_ctx(n_ctx)
    tokens, bos_id = tokenize(tokenizer, text)
    return plan_chunks(tokens, n_ctx, n_chunks, bos_id)


def format_running(report: ChunkReport) -> str:
    """llama-perplexity's progress item: `[3]12.3456,`."""
    return f"[{report.index}]{report.running_ppl:.4f},"


def format_final(result: PerplexityResult) -> str:
    if result.ppl_stderr is None:
        return f"Final estimate: PPL = {result.ppl:.4f} (no standard error: the NLL variance is not positive)"
    return f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f}"
