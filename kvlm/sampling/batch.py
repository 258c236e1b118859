"""Sampling a step's rows at once where their logits are (a GPU's memory): one argmax over every greedy row, the
random rows' temperature, top-k, top-p and min-p as tensor ops over all of them, and one copy of the chosen ids back.

Each row gives what RequestSampler.sample gives for it (kvlm.sampling.sampler has the order of the steps and their
definitions): its constraint's mask, bias and penalties (each request's own, applied to its row where it is), the
same draw from the request's own generator (one uniform number per random token, so a seeded request gives the same
tokens whichever way it is sampled), walked over the candidates in the same order: the vocabulary's where neither
top-k nor top-p is set, else most likely first. Ties between equal logits may break differently (a GPU's sort), and
a uniform number landing within rounding of a boundary between two tokens may pick the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlm.core.staging import staged
from kvlm.sampling.sampler import RequestSampler, SampledToken
from kvlm.structured.request_grammar import TokenMask


@dataclass
class Row:
    """One request's row of the step's logits, with its sampler and its constraint's mask (None: every token)."""

    sampler: RequestSampler
    allowed: TokenMask | None = None


def sample_rows(logits: torch.Tensor, rows: list[Row]) -> list[SampledToken]:
    """The next token of each row of `logits` [len(rows), vocab] (float32, on any device; left unchanged), each
    recorded for its request's penalties."""
    processed = _processed(logits, rows)
    ids = processed.argmax(dim=1)
    random = [i for i, row in enumerate(rows) if not row.sampler.params.greedy]
    if random:
        index = _indices(random, logits.device)
        ids[index] = _draw(processed[index], [rows[i].sampler for i in random])
    return [row.sampler.record(token_id, logits[i]) for i, (row, token_id) in enumerate(zip(rows, ids.tolist()))]


def _processed(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The rows masked by their constraints (the masks copied to the device together), then biased and penalised."""
    masked = [i for i, row in enumerate(rows) if row.allowed is not None]
    out = logits
    if masked:
        masks = staged(torch.stack([rows[i].allowed.tokens() for i in masked]), logits.device)
        index = _indices(masked, logits.device)
        out = logits.clone()
        out[index] = torch.where(masks, logits[index], float("-inf"))
    changed = [i for i, row in enumerate(rows) if not row.sampler.argmax_only]
    if changed:
        out = out.clone() if out is logits else out
        for i in changed:
            out[i] = rows[i].sampler.process(out[i])
    return out


def _draw(logits: torch.Tensor, samplers: list[RequestSampler]) -> torch.Tensor:
    """One random token per row: temperature, top-k, top-p (over the top-k), softmax, min-p, then each request's
    uniform number against the float64 CDF of what is left."""
    device, vocab = logits.device, logits.shape[1]
    # each row's parameters and uniform number, copied in one go: temperature, top-k, top-p, min-p, ranked, u
    table = staged(torch.tensor([[p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p,
                                  0 < p.top_k < vocab or p.top_p < 1.0, sampler.uniform()]
                                 for p, sampler in ((s.params, s) for s in samplers)], dtype=torch.float64), device)
    temperature, top_k, top_p, min_p, ranked, u = table.T[:, :, None]
    top_p, min_p, ranked, top_k = top_p.float(), min_p.float(), ranked.bool(), top_k.long()
    logits = logits.float() / temperature.float()
    # the candidates' order: most likely first where top-k or top-p choose among them, the vocabulary's otherwise
    order = torch.arange(vocab, device=device).expand(len(samplers), vocab)
    if any(0 < s.params.top_k < vocab or s.params.top_p < 1.0 for s in samplers):  # (a sort only where one is needed)
        order = torch.where(ranked, torch.sort(logits, dim=1, descending=True, stable=True).indices, order)
    values = logits.gather(1, order)
    rank = torch.arange(vocab, device=device)[None, :]
    values = values.masked_fill(ranked & (rank >= top_k), float("-inf"))
    cumulative = torch.cumsum(torch.exp(values - torch.logsumexp(values, dim=1, keepdim=True)), dim=1)
    before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))  # what the more likely candidates add up to
    values = values.masked_fill(ranked & (top_p < 1.0) & (before >= top_p) & (rank > 0), float("-inf"))
    probs = torch.softmax(values, dim=1)
    probs = probs.masked_fill(probs < min_p * probs.amax(dim=1, keepdim=True), 0.0)
    cumulative = torch.cumsum(probs, dim=1, dtype=torch.float64)
    index = torch.searchsorted(cumulative, cumulative[:, -1:] * u, right=True)
    last = vocab - 1 - (probs > 0).flip(1).int().argmax(dim=1, keepdim=True)  # u rounded up to the total
    index = torch.where(index >= vocab, last, index)
    return order.gather(1, index).flatten()


def _indices(rows: list[int], device: torch.device) -> torch.Tensor:
    return staged(torch.tensor(rows, dtype=torch.int64), device)
