"""SamplingParams validation and the per-request sampler, on hand-made logits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlm.sampling.sampler import RequestSampler, SampledToken, _inverse_cdf, _nucleus
from kvlm.sampling.params import SamplingParams
from kvlm.sampling.sampler import sample_token

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])  # softmax: .561 .206 .125 .076 .028 .004
N_DRAWS = 20_000
# chi-square critical values at p = 1e-4, by degrees of freedom: a right sampler fails 1 seed in 10,000
CHI2_CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


# --- SamplingParams ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_an_invalid_parameter_is_a_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_boundary_values_are_valid():
    SamplingParams(
        max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, min_p=1.0, repetition_penalty=1e-3,
        presence_penalty=-2.0, frequency_penalty=2.0, logprobs=0, logit_bias={0: -100, 7: 100}, seed=-(2**63),
    )
    SamplingParams(top_k=-1, top_p=1e-9, min_p=0.0, seed=2**64 - 1)


def test_from_dict_rejects_unknown_keys_and_reads_json():
    with pytest.raises(ValueError, match="unknown sampling parameter 'foo'"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})
    params = SamplingParams.from_dict({"temperature": None, "logit_bias": {"17": 5}, "stop": "\n", "top_k": 3})
    assert params == SamplingParams(logit_bias={17: 5.0}, stop=["\n"], top_k=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"seventeen": 5}})


def test_values_are_normalised_and_the_params_hashable():
    params = SamplingParams(stop="###", stop_token_ids=[3, 4], temperature=1, logit_bias={2: 1})
    assert params.stop == ("###",) and params.stop_token_ids == (3, 4)
    assert isinstance(params.temperature, float) and params.logit_bias == {2: 1.0}
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams().stop == ()
    assert hash(params) == hash(SamplingParams(stop=("###",), stop_token_ids=(3, 4), logit_bias={2: 1.0}))


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # vLLM's epsilon
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy and not SamplingParams(top_k=2).greedy


# --- choosing tokens ------------------------------------------------------------------------------------


def draws(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N_DRAWS) -> list[int]:
    sampler = RequestSampler(params, [])
    return [sampler.sample(logits).token_id for _ in range(n)]


def counts_of(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def assert_distribution(tokens: list[int], expected: torch.Tensor) -> None:
    """Tokens with probability 0 never drawn; the others pass a chi-square test against `expected`.

    Tokens expected fewer than 5 times are pooled into one cell, as the test needs.
    """
    expected = expected.double() / expected.sum()
    counts = counts_of(tokens, len(expected))
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts.tolist()}"
    n = counts.sum()
    rare = support & (n * expected < 5)
    cells = support & ~rare
    observed = torch.cat([counts[cells], counts[rare].sum().reshape(1)])
    wanted = torch.cat([n * expected[cells], n * expected[rare].sum().reshape(1)])
    if not rare.any():
        observed, wanted = observed[:-1], wanted[:-1]
    df = len(observed) - 1
    if df == 0:
        return
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    assert chi2 < CHI2_CRITICAL[df], f"chi2 {chi2:.1f} (df {df}): {counts.tolist()} vs {(n * expected).tolist()}"


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference top-p: the smallest most-likely-first set reaching top_p, as a 0/1 mask."""
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    mask, total = torch.zeros(len(probs)), 0.0
    for i in order:
        mask[i] = 1
        total += float(probs[i])
        if total >= top_p:
            break
    return mask


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_softmax_of_logits_over_t(temperature):
    tokens = draws(SamplingParams(temperature=temperature, seed=1))
    assert_distribution(tokens, torch.softmax(LOGITS.double() / temperature, 0))


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_top_k_draws_only_the_k_best_in_proportion(top_k):
    tokens = draws(SamplingParams(temperature=1.0, top_k=top_k, seed=2), n=N_DRAWS // 2)
    probs = torch.softmax(LOGITS.double(), 0)
    probs[top_k:] = 0  # LOGITS is sorted
    assert_distribution(tokens, probs)


@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.95])
def test_top_p_draws_only_the_nucleus_in_proportion(top_p):
    shuffled = LOGITS[torch.tensor([3, 0, 5, 2, 4, 1])]  # the vocabulary order is not the likelihood order
    tokens = draws(SamplingParams(temperature=1.0, top_p=top_p, seed=3), shuffled, n=N_DRAWS // 2)
    probs = torch.softmax(shuffled.double(), 0)
    assert_distribution(tokens, probs * nucleus(probs, top_p))


def test_top_p_over_a_large_vocabulary_keeps_exactly_the_nucleus():
    """Every path: a nucleus within the best 64, within the best 512, and one that needs the full sort."""
    generator = torch.Generator().manual_seed(0)
    sizes = []
    for scale, top_p in [(8.0, 0.9), (4.0, 0.5), (3.0, 0.9), (0.5, 0.9), (1.0, 0.999)]:
        logits = torch.randn(5000, generator=generator) * scale
        probs = torch.softmax(logits.double(), 0)
        inside = nucleus(probs, top_p).bool()
        _, kept = _nucleus(logits, None, top_p)
        assert sorted(kept.tolist()) == torch.nonzero(inside).flatten().tolist()
        tokens = torch.tensor(draws(SamplingParams(top_p=top_p, seed=4), logits, n=200))
        assert inside[tokens].all()
        sizes.append(int(inside.sum()))
    assert min(sizes) < 64 and any(64 < s < 512 for s in sizes) and max(sizes) > 512


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    min_p = 0.1  # keeps p >= 0.0561: tokens 0-3
    tokens = draws(SamplingParams(temperature=1.0, min_p=min_p, seed=5), n=N_DRAWS // 2)
    probs = torch.softmax(LOGITS.double(), 0)
    probs[probs < min_p * probs.max()] = 0
    assert probs[3] > 0 and probs[4] == 0
    assert_distribution(tokens, probs)


def test_temperature_top_k_top_p_min_p_together():
    params = SamplingParams(temperature=2.0, top_k=5, top_p=0.85, min_p=0.3, seed=6)
    probs = torch.softmax(LOGITS.double() / 2.0, 0)  # .391 .237 .185 .144 .087 .032
    probs[5:] = 0  # top-k
    probs = probs / probs.sum() * nucleus(probs / probs.sum(), 0.85)  # top-p keeps 4 of the 5
    probs[probs < 0.3 * probs.max()] = 0  # min-p then drops none of the 4
    assert int((probs > 0).sum()) == 4
    assert_distribution(draws(params, n=N_DRAWS // 2), probs)


def test_top_k_1_is_greedy():
    generator = torch.Generator().manual_seed(7)
    for _ in range(20):
        logits = torch.randn(1000, generator=generator) * 3
        greedy = RequestSampler(SamplingParams(temperature=0.0), [])
        top_1 = RequestSampler(SamplingParams(temperature=1.5, top_k=1), [])
        assert top_1.sample(logits).token_id == greedy.sample(logits).token_id == int(logits.argmax())


def test_greedy_takes_the_argmax_after_penalties():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert RequestSampler(params, [0]).sample(logits).token_id == 1
    assert RequestSampler(params, [2]).sample(logits).token_id == 0


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    first = draws(params, logits, n=50)
    assert first == draws(params, logits, n=50)
    assert first != draws(SamplingParams(temperature=1.0, top_p=0.9, seed=1235), logits, n=50)
    assert len(set(first)) > 5


def test_a_seeded_request_is_independent_of_others_interleaved():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(9))
    params = SamplingParams(temperature=0.8, top_k=50, seed=42)
    alone = draws(params, logits, n=40)
    mine = RequestSampler(params, [])
    others = [RequestSampler(SamplingParams(temperature=1.0, seed=s), []) for s in range(3)]
    others.append(RequestSampler(SamplingParams(temperature=1.0), []))  # unseeded
    torch.manual_seed(0)  # the global generator is not used either
    interleaved = []
    for step in range(40):
        for other in others[: step % 5]:
            other.sample(logits)
        torch.rand(3)
        interleaved.append(mine.sample(logits).token_id)
    assert interleaved == alone


def test_unseeded_requests_differ():
    logits = torch.zeros(1000)
    assert draws(SamplingParams(), logits, n=20) != draws(SamplingParams(), logits, n=20)


# --- logit processing ----------------------------------------------------------------------------------

RAW = torch.tensor([2.0, -1.0, 0.5, 0.0, -3.0, 1.5])


def force(sampler: RequestSampler, token_id: int) -> None:
    """Make `sampler` generate `token_id` (params must be greedy), so it counts for the penalties."""
    logits = torch.zeros(len(RAW))
    logits[token_id] = 1000.0
    assert sampler.sample(logits).token_id == token_id


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    sampler = RequestSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0, 1, 1])
    torch.testing.assert_close(sampler.process(RAW), torch.tensor([1.0, -2.0, 0.5, 0.0, -3.0, 1.5]))
    force(sampler, 2)
    force(sampler, 4)
    torch.testing.assert_close(sampler.process(RAW), torch.tensor([1.0, -2.0, 0.25, 0.0, -6.0, 1.5]))
    below_one = RequestSampler(SamplingParams(temperature=0.0, repetition_penalty=0.5), [0, 1])
    torch.testing.assert_close(below_one.process(RAW), torch.tensor([4.0, -0.5, 0.5, 0.0, -3.0, 1.5]))


@pytest.mark.parametrize("frequency, presence", [(0.5, 0.25), (-1.0, 0.0), (0.0, 2.0), (2.0, -2.0)])
def test_frequency_and_presence_penalties_count_only_output_tokens(frequency, presence):
    params = SamplingParams(temperature=0.0, frequency_penalty=frequency, presence_penalty=presence)
    sampler = RequestSampler(params, [0, 1, 5])  # the prompt does not count
    torch.testing.assert_close(sampler.process(RAW), RAW)
    for token_id in (2, 2, 4, 2):
        force(sampler, token_id)
    expected = RAW.clone()
    expected[2] -= 3 * frequency + presence
    expected[4] -= 1 * frequency + presence
    torch.testing.assert_close(sampler.process(RAW), expected)


def test_logit_bias_is_added_first():
    params = SamplingParams(temperature=0.0, logit_bias={1: 5.0, 5: -100.0, 0: -4.0}, repetition_penalty=2.0)
    sampler = RequestSampler(params, [0])
    # token 0: 2 - 4 = -2, then the repetition penalty (a negative logit) makes it -4; penalty first would give -3
    torch.testing.assert_close(sampler.process(RAW), torch.tensor([-4.0, 4.0, 0.5, 0.0, -3.0, -98.5]))
    assert sampler.sample(RAW).token_id == 1
    biased = draws(SamplingParams(logit_bias={5: 100.0}, seed=10), n=200)
    assert biased.count(5) == 200


def test_processing_leaves_the_callers_logits_alone():
    logits = RAW.clone()
    params = SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1, logit_bias={3: 2.0},
                            repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.4, seed=0)
    sampler = RequestSampler(params, [0, 2])
    for _ in range(5):
        sampler.sample(logits)
    assert torch.equal(logits, RAW)


def test_logit_bias_or_prompt_outside_the_vocabulary_is_a_value_error():
    with pytest.raises(ValueError, match="logit_bias"):
        RequestSampler(SamplingParams(logit_bias={6: 1.0}), []).sample(RAW)
    with pytest.raises(ValueError, match="prompt token ids"):
        RequestSampler(SamplingParams(repetition_penalty=1.2), [0, 6]).sample(RAW)


# --- logprobs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_of_the_raw_logits_and_sorted(temperature):
    logits = torch.randn(500, generator=torch.Generator().manual_seed(11)) * 2
    raw = torch.log_softmax(logits, 0)
    params = SamplingParams(temperature=temperature, top_k=20, logprobs=5, repetition_penalty=1.5,
                            logit_bias={3: 10.0}, seed=12)
    sampler = RequestSampler(params, [int(logits.argmax())])
    for _ in range(10):
        token = sampler.sample(logits)
        assert math.isclose(token.logprob, float(raw[token.token_id]), rel_tol=1e-6, abs_tol=1e-6)
        assert [i for i, _ in token.top_logprobs] == raw.topk(5).indices.tolist()
        values = [lp for _, lp in token.top_logprobs]
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), raw.topk(5).values)


def test_logprobs_zero_gives_only_the_chosen_token_and_none_gives_nothing():
    chosen = RequestSampler(SamplingParams(temperature=0, logprobs=0), []).sample(RAW)
    assert chosen.token_id == 0 and chosen.top_logprobs == []
    assert chosen.logprob == pytest.approx(float(torch.log_softmax(RAW, 0)[0]))
    assert RequestSampler(SamplingParams(temperature=0), []).sample(RAW) == SampledToken(0, None, None)
    many = RequestSampler(SamplingParams(temperature=0, logprobs=100), []).sample(RAW)
    assert len(many.top_logprobs) == len(RAW)


# --- the single-sequence entry point ------------------------------------------------------------------


def test_sample_token_keeps_its_contract():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(13))
    assert sample_token(logits, 0.0, None) == int(logits.argmax())
    with pytest.raises(ValueError, match="temperature"):
        sample_token(logits, -1.0, None)
    first = [sample_token(logits, 1.0, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(first)) == 1
    generator = torch.Generator().manual_seed(5)
    drawn = [sample_token(LOGITS, 0.5, generator) for _ in range(N_DRAWS // 2)]
    assert_distribution(drawn, torch.softmax(LOGITS.double() / 0.5, 0))


@pytest.mark.parametrize("n", [5, 1024, 3000, 49152])
def test_the_inverse_cdf_is_the_first_token_past_the_point(n):
    """The two-level search against one float64 running total (numpy's): vocabularies of part of a block, one block,
    several with a partial last one; tokens and a whole block of probability 0 never drawn; u just below 1 gives
    the last token with any probability."""
    rng = np.random.default_rng(n)
    p = (rng.random(n) ** 8).astype(np.float32)  # skewed, as softmax outputs are
    p[rng.random(n) < 0.3] = 0.0
    if n == 3000:
        p[2048:] = 0.0  # the last, partial block empty
    cumulative = np.cumsum(p.astype(np.float64))
    probs = torch.from_numpy(p)
    for u in rng.random(300):
        expected = int(np.searchsorted(cumulative, cumulative[-1] * u, side="right"))
        assert _inverse_cdf(probs, float(u)) == expected, u
    assert _inverse_cdf(probs, 1.0 - 2.0 ** -53) == int(np.flatnonzero(p)[-1])
