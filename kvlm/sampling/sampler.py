"""Choosing one request's next token from its logits, in vLLM's order.

0. a structured-output constraint's mask: tokens the grammar does not allow get -inf, so nothing after can
   bring them back;
1. logit_bias is added;
2. repetition penalty over prompt and output tokens (transformers/vLLM: a positive logit is divided by the
   penalty, a negative or zero one multiplied);
3. frequency and presence penalties over output tokens only (OpenAI:
   `logit -= frequency_penalty * count + presence_penalty * (count > 0)`);
4. greedy (see `SamplingParams.greedy`): argmax. Otherwise temperature, then top-k, then top-p (the
   smallest set of most likely tokens whose probability adds up to at least top_p, never empty), then
   min-p (drop tokens less likely than min_p times the most likely one), and a draw from what is left.

The order of the last three is vLLM's V0 sampler's; vLLM V1 applies min-p before top-k/top-p, which can
only differ when min-p and top-p are both set (top-p then sees the distribution min-p already cut).

Logprobs are those of the raw model logits, before any of the above (the mask included) (vLLM's default "raw_logprobs").

Each request owns its `torch.Generator`, seeded from `seed` or else from the OS, and draws from it once per
random step: a seeded request gives the same tokens whatever else runs beside it. (vLLM draws unseeded
requests from one shared generator; the result is equally random.)
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvlm.sampling.params import SamplingParams
from kvlm.structured.request_grammar import TokenMask


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # of the chosen token under the raw logits, when logprobs was asked for
    top_logprobs: list[tuple[int, float]] | None = None  # the `logprobs` most likely (id, logprob), best first


class RequestSampler:
    """One request's sampler: its random generator and the token counts its penalties need."""

    def __init__(self, params: SamplingParams, prompt_token_ids: Iterable[int]) -> None:
        self.params = params
        # Greedy without bias or penalties is only an argmax: the hot path, nothing to set up or record.
        self.argmax_only = params.greedy and not params.logit_bias and not params.has_penalties
        self._repetition = params.repetition_penalty != 1.0
        self._frequency = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._generator: torch.Generator | None = None
        self._vocab_size: int | None = None  # known at the first step
        self._bias_ids: torch.Tensor | None = None
        self._bias_values: torch.Tensor | None = None
        # Penalties touch only the tokens seen, by index: a few hundred, not the whole vocabulary.
        self._seen: set[int] = set(prompt_token_ids) if self._repetition else set()  # prompt and output
        self._seen_ids: torch.Tensor | None = None  # the same as a tensor, rebuilt when a new id comes
        self._counts: dict[int, int] = {}  # output token -> times generated
        self._counted_ids: torch.Tensor | None = None
        self._counted_values: torch.Tensor | None = None

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            seed = self.params.seed
            if seed is None:
                seed = int.from_bytes(os.urandom(8), "little")
            self._generator = torch.Generator().manual_seed(seed)
        return self._generator

    def sample(self, logits: torch.Tensor, allowed: TokenMask | None = None) -> SampledToken:
        """The next token from this step's logits (float32 [vocab], left unchanged); recorded for penalties.

        `allowed`: the tokens a constraint lets through this step (a TokenMask; None: all of them). A greedy row
        tests only its argmax against it, and masks the logits only when that token is not allowed."""
        params = self.params
        raw = logits
        if allowed is not None and not params.greedy:
            logits = torch.where(allowed.tokens(), logits, float("-inf"))  # (several times faster than masked_fill)
        processed = logits if self.argmax_only else self.process(logits)
        token_id = argmax(processed) if params.greedy else draw(processed, params, self.uniform())
        if allowed is not None and params.greedy and not allowed.allows(token_id):
            # Bias and penalties leave a masked -inf at -inf, so the argmax of the masked logits is that of the
            # processed ones among the allowed tokens: only needed when the free argmax is not allowed.
            token_id = argmax(torch.where(allowed.tokens(), processed, float("-inf")))
        return self.record(token_id, raw)

    def record(self, token_id: int, raw: torch.Tensor) -> SampledToken:
        """The chosen token, counted for the penalties, with its logprobs under the raw logits where asked for."""
        if not self.argmax_only:
            self._record(token_id)
        if self.params.logprobs is None:
            return SampledToken(token_id)
        return SampledToken(token_id, *logprobs_of(raw, token_id, self.params.logprobs))

    def uniform(self) -> float:
        """This request's next random number in [0, 1), float64 (one per random token)."""
        return uniform(self.generator)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits after logit_bias and the penalties: a new tensor, or `logits` itself if nothing applies."""
        if self._vocab_size is None:
            self._set_up(logits)
        elif logits.shape != (self._vocab_size,):
            raise ValueError(f"logits of shape {tuple(logits.shape)}; this request's were ({self._vocab_size},)")
        params = self.params
        if logits.dtype != torch.float32:
            logits = logits.float()
        device = logits.device  # (a GPU's, where the step samples there: the few ids and values go to it)
        if self._bias_ids is not None:
            logits = logits.index_add(0, self._bias_ids.to(device), self._bias_values.to(device))
        if self._repetition and self._seen:
            if self._seen_ids is None:
                self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
            logits = logits.clone() if self._bias_ids is None else logits
            seen = self._seen_ids.to(device)
            values = logits[seen]
            penalty = params.repetition_penalty
            logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if self._frequency and self._counts:
            if self._counted_ids is None:
                self._counted_ids = torch.tensor(list(self._counts), dtype=torch.long)
                self._counted_values = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            subtract = self._counted_values * params.frequency_penalty + params.presence_penalty
            logits = logits.index_add(0, self._counted_ids.to(device), subtract.to(device), alpha=-1)
        return logits

    def _set_up(self, logits: torch.Tensor) -> None:
        if logits.dim() != 1:
            raise ValueError(f"logits must be one vector [vocab], got shape {tuple(logits.shape)}")
        vocab_size = logits.shape[0]
        bias = self.params.logit_bias
        if bias:
            outside = sorted(i for i in bias if i >= vocab_size)
            if outside:
                raise ValueError(f"logit_bias has token ids outside the vocabulary of {vocab_size}: {outside}")
            self._bias_ids = torch.tensor(list(bias), dtype=torch.long)
            self._bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
        outside = sorted(i for i in self._seen if not 0 <= i < vocab_size)
        if outside:
            raise ValueError(f"prompt token ids outside the vocabulary of {vocab_size}: {outside}")
        self._vocab_size = vocab_size

    def _record(self, token_id: int) -> None:
        if self._repetition and token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_ids = None
        if self._frequency:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
            self._counted_ids = None


def argmax(logits: torch.Tensor) -> int:
    """The first index of the largest value; numpy's argmax is several times faster than torch's here."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu":
        return int(logits.detach().numpy().argmax())
    return int(torch.argmax(logits))


def draw(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """A random token: temperature, top-k, top-p, min-p, then the one `u` (uniform in [0, 1)) picks."""
    logits = logits.float()
    if params.temperature != 1.0:
        logits = logits / params.temperature
    ids = None  # the candidates' token ids, once they are a subset of the vocabulary (most likely first)
    if 0 < params.top_k < logits.shape[0]:
        logits, ids = torch.topk(logits, params.top_k)
    if params.top_p < 1.0:
        logits, ids = _nucleus(logits, ids, params.top_p)
    probs = torch.softmax(logits, dim=0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    choice = _inverse_cdf(probs, u)
    return int(ids[choice]) if ids is not None else choice


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The single-sequence loop's choice (kvlm.runtime.generate): greedy at temperature 0, otherwise a draw from
    softmax(logits / temperature) with `generator`. Requests that need top-k/top-p/min-p, penalties or logprobs use
    RequestSampler."""
    params = SamplingParams(temperature=temperature)  # ValueError for a negative temperature
    if params.greedy:
        return int(torch.argmax(logits))
    return draw(logits, params, uniform(generator))


def uniform(generator: torch.Generator | None) -> float:
    """One random number in [0, 1), float64, from `generator` (None: torch's global one)."""
    return float(torch.rand(1, dtype=torch.float64, generator=generator))


def _nucleus(
    logits: torch.Tensor, ids: torch.Tensor | None, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely candidates whose probability adds up to at least top_p, best first.

    A token is kept when the tokens more likely than it add up to less than top_p, so the first always is.
    Top-k candidates come sorted. The whole vocabulary does not, and torch's sort of it costs milliseconds:
    the most likely 64, then 512 are tried, and only a flat distribution needs a full (numpy) sort.
    """
    log_total = torch.logsumexp(logits, dim=0)
    n = logits.shape[0]
    for k in ((n,) if ids is not None else (64, 512, n)):
        k = min(k, n)
        if ids is not None:
            values, order = logits, ids
        elif k < n:
            values, order = torch.topk(logits, k)
        else:
            order = _argsort_descending(logits)
            values = logits[order]
        cumulative = torch.cumsum(torch.exp(values - log_total), dim=0)
        if k == n or cumulative[-1] >= top_p:
            break
    keep = int(torch.count_nonzero(cumulative[:-1] < top_p)) + 1
    return values[:keep], order[:keep]


def _argsort_descending(values: torch.Tensor) -> torch.Tensor:
    if values.device.type == "cpu":
        return torch.from_numpy(np.argsort(-values.detach().numpy()))  # several times faster than torch.sort
    return torch.argsort(values, descending=True)


CDF_BLOCK = 1024  # tokens per block of the inverse CDF's first level


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """One draw from `probs` (not necessarily normalised): the first token whose float64 CDF exceeds `u` times the
    total, found in two levels: the blocks' float64 sums and their running total, then the running total inside
    the one block that holds the point. (A running total over the whole vocabulary took 60 us at 49k tokens and
    1.5 ms at 248k; torch.multinomial gives the same distribution but costs milliseconds too.)

    Rounding may put the point past a block's last token with any probability, or past the total where `u` rounds
    up to it: then that last token."""
    n = probs.shape[0]
    whole = n - n % CDF_BLOCK
    sums = probs[:whole].reshape(-1, CDF_BLOCK).sum(dim=1, dtype=torch.float64)  # (a view where probs is contiguous)
    if whole < n:
        sums = torch.cat((sums, probs[whole:].sum(dtype=torch.float64).view(1)))
    ends = torch.cumsum(sums, dim=0)
    point = ends[-1:] * u
    block = int(torch.searchsorted(ends, point, right=True))
    if block >= len(ends):
        block = int(torch.nonzero(sums)[-1])
    start = block * CDF_BLOCK
    part = probs[start:start + CDF_BLOCK]
    within = torch.cumsum(part, dim=0, dtype=torch.float64)
    if block:
        within += ends[block - 1]
    index = int(torch.searchsorted(within, point, right=True))
    if index >= len(part):
        index = int(torch.nonzero(part)[-1])
    return start + index


def logprobs_of(logits: torch.Tensor, token_id: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the n best (id, logprob), best first, under softmax(logits)."""
    logprobs = torch.log_softmax(logits.float(), dim=0)
    top: list[tuple[int, float]] = []
    if n > 0:
        values, ids = torch.topk(logprobs, min(n, logprobs.shape[0]))
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token_id]), top
