"""Sampling a step's rows at once (kvlm.sampling.batch, the GPU's way) against each request's own sampler
(RequestSampler, the CPU's way) on the same logits: the same tokens, step after step (penalties counting what was
chosen), for greedy and random rows of every kind of parameter, with and without a constraint's mask, from
generators seeded alike; the same logprobs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlm.sampling.batch import Row, sample_rows
from kvlm.sampling.params import SamplingParams
from kvlm.sampling.sampler import RequestSampler
from kvlm.structured.request_grammar import TokenMask

VOCAB = 300
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={7: 3.0}),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, seed=2),
    SamplingParams(temperature=1.3, top_k=20, seed=3),
    SamplingParams(temperature=1.0, top_p=0.8, seed=4),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.6, seed=5),
    SamplingParams(temperature=1.0, min_p=0.05, seed=6),
    SamplingParams(temperature=1.1, top_p=0.9, min_p=0.1, seed=7),
    SamplingParams(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, seed=8),
    SamplingParams(temperature=1.0, top_k=1, seed=9),
    SamplingParams(temperature=1.0, logprobs=3, logit_bias={0: -5.0}, seed=10),
]
PROMPT = [3, 9, 27, 81]


def _mask(seed: int) -> TokenMask:
    """A random third of the vocabulary, as llguidance's bitmask words."""
    rng = np.random.default_rng(seed)
    bits = rng.random(VOCAB + (-VOCAB % 32)) < 0.33
    bits[0] = True
    return TokenMask(torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy()), VOCAB)


@pytest.mark.parametrize("masked", [False, True])
def test_rows_sampled_at_once_are_those_each_sampler_takes(masked):
    one_by_one = [RequestSampler(p, PROMPT) for p in PARAMS]
    at_once = [RequestSampler(p, PROMPT) for p in PARAMS]
    generator = torch.Generator().manual_seed(0)
    for step in range(25):
        logits = torch.randn(len(PARAMS), VOCAB, generator=generator) * 3
        masks = [_mask(100 * step + i) if masked and i % 2 else None for i in range(len(PARAMS))]
        want = [s.sample(logits[i], masks[i]) for i, s in enumerate(one_by_one)]
        got = sample_rows(logits.clone(), [Row(s, m) for s, m in zip(at_once, masks)])
        assert [t.token_id for t in got] == [t.token_id for t in want], step
        for a, b in zip(got, want):
            assert (a.logprob is None) == (b.logprob is None)
            if a.logprob is not None:
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
        if masked:
            assert all(m is None or m.allows(t.token_id) for m, t in zip(masks, got))


def test_the_logits_are_left_unchanged():
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    sample_rows(logits, [Row(RequestSampler(p, PROMPT), _mask(i)) for i, p in enumerate(PARAMS)])
    assert torch.equal(logits, before)
