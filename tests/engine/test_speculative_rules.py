"""Speculative decoding's rules: sampled tokens keep the target's distribution; stop strings, stop tokens, max_tokens
and the end of the context cut where they would without guesses; the prefix cache holds only committed tokens; the
configuration is checked; the engine stops guessing where guesses fail and keeps guessing where they pay."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvlm.speculative.speculator as speculator_module
from kvlm import LLM, Batch, Context, SamplingParams
from kvlm.engine.engine import PREFIX_CACHE_SEQ, Engine
from kvlm.speculative.config import SpeculativeConfig
from kvlm.speculative.tuning import Acceptance, Candidate, StepCosts, choose_guesses
from helpers.speculative import NGRAM, REPEATING, _random_gguf, exact_model, oracle_guesses

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return exact_model(_random_gguf("llama-llama3", tmp_path_factory.mktemp("llama")))


def _outputs(model, prompts, params, speculative=None, n_ctx=256):
    llm = LLM(model, n_ctx=n_ctx, max_num_seqs=4, speculative_config=speculative)
    return llm.generate(prompts, params, use_tqdm=False), llm


# --- the configuration -------------------------------------------------------------------------------------------

def test_vllm_spellings_parse():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == \
        ("ngram", 5, 3, 1)
    draft = SpeculativeConfig.parse({"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4})
    assert draft.method == "draft_model" and draft.adaptive


@pytest.mark.parametrize("value, named", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 40}', "32"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "5"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}', "draft_tp"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ("{not json", "JSON"),
])
def test_bad_configs_are_refused_naming_the_value(value, named):
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.parse(value)


# --- sampling keeps the target's distribution ----------------------------------------------------------------------

def test_sampled_tokens_follow_the_target_distribution(llama):
    """The first two generated tokens of many seeded requests, with guesses that are sometimes right: their joint
    frequencies against the probabilities the model's own logits give (temperature 1, top-k 4), by chi-square."""
    prompt, k_top, n = [1, 17, 33, 65, 120], 4, 800
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=k_top, seed=seed, ignore_eos=True)
              for seed in range(n)]
    expected = _joint_probabilities(llama, prompt, k_top)
    likely = {t1: max(row, key=row.get) for t1, row in _conditionals(llama, prompt, k_top).items()}

    def guess_the_likeliest(tokens, min_n, max_n, k, max_len=None):  # right with probability p(likeliest)
        tokens = list(tokens)
        return [likely[tokens[len(prompt)]], 7] if len(tokens) == len(prompt) + 1 else []

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculator_module, "propose_ngram", guess_the_likeliest)
        outputs, llm = _outputs(llama, [prompt] * n, params, NGRAM)
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    counts: dict[tuple[int, int], int] = {}
    for output in outputs:
        pair = tuple(output.token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    assert set(counts) <= set(expected)
    statistic = sum((counts.get(pair, 0) - n * p) ** 2 / (n * p) for pair, p in expected.items())
    assert statistic < 44.6, (statistic, counts)  # chi-square, 15 degrees of freedom: its 0.9999 quantile


def _conditionals(model, prompt, k_top) -> dict[int, dict[int, float]]:
    first = _top_k_probabilities(_logits(model, prompt), k_top)
    return {t1: _top_k_probabilities(_logits(model, prompt + [t1]), k_top) for t1 in first}


def _joint_probabilities(model, prompt, k_top) -> dict[tuple[int, int], float]:
    first = _top_k_probabilities(_logits(model, prompt), k_top)
    return {(t1, t2): p1 * p2 for t1, p1 in first.items()
            for t2, p2 in _top_k_probabilities(_logits(model, prompt + [t1]), k_top).items()}


def _logits(model, ids) -> torch.Tensor:
    context = Context(model, n_ctx=64, n_seq_max=1, kv_dtype="f16")
    context.decode(Batch(tokens=ids, seq_ids=[0] * len(ids)))
    return context.get_logits_ith(-1)


def _top_k_probabilities(logits: torch.Tensor, k: int) -> dict[int, float]:
    values, ids = torch.topk(logits.double(), k)
    return dict(zip(ids.tolist(), torch.softmax(values, 0).tolist()))


# --- where a request ends ------------------------------------------------------------------------------------------

def _oracle(monkeypatch, model, prompts, expected):
    monkeypatch.setattr(speculator_module, "propose_ngram",
                        oracle_guesses(prompts, [o.token_ids for o in expected], model.config.vocab_size))


@pytest.mark.parametrize("ending", ["stop string", "stop token", "max_tokens", "context"])
def test_requests_end_where_they_would_without_guesses(llama, monkeypatch, ending):
    prompts = [REPEATING, [1, 40, 41, 42, 43] * 4]
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    long_outputs, _ = _outputs(llama, prompts, free)
    _oracle(monkeypatch, llama, prompts, long_outputs)  # guesses run on past every ending
    tokenizer, n_ctx = llama.tokenizer, 256
    if ending == "stop string":
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                 stop=[tokenizer.decode(o.token_ids[9:11])]) for o in long_outputs]
    elif ending == "stop token":
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                 stop_token_ids=[o.token_ids[12]]) for o in long_outputs]
    elif ending == "max_tokens":
        params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    else:
        params, n_ctx = free, len(REPEATING) + 13
    expected, _ = _outputs(llama, prompts, params, n_ctx=n_ctx)
    _oracle(monkeypatch, llama, prompts, long_outputs)
    got, llm = _outputs(llama, prompts, params, NGRAM, n_ctx=n_ctx)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in expected]


def test_the_prefix_cache_holds_only_committed_tokens(llama):
    """After requests finish, the cached blocks are the same tokens with the same K/V bytes as without guesses."""
    params = SamplingParams(max_tokens=45, temperature=0.0, ignore_eos=True)
    caches = []
    for speculative in (None, NGRAM):
        engine = Engine(llama, n_ctx=256, max_num_seqs=2, speculative_config=speculative)
        engine.add_request(REPEATING, params)
        while engine.has_unfinished():
            engine.step()
        pool = engine.context.memory.pools[0]
        cells = pool.cells.seq_cells(PREFIX_CACHE_SEQ)
        caches.append({int(pool.cells.pos[c]): (pool.store.k.data[:, c].clone(), pool.store.v.data[:, c].clone())
                       for c in cells})
    plain, speculated = caches
    assert plain and set(speculated) <= set(range(len(REPEATING) + 45))
    common = set(plain) & set(speculated)
    assert len(common) >= len(plain) - 16  # (the last block may end one token later)
    assert all(torch.equal(plain[p][0], speculated[p][0]) and torch.equal(plain[p][1], speculated[p][1])
               for p in common)


# --- self-tuning -----------------------------------------------------------------------------------------------------

def test_step_costs_interpolate_and_never_fall_with_rows():
    costs = StepCosts()
    for rows, seconds in ((1, 0.010), (2, 0.011), (5, 0.014)):
        costs.observe(rows, seconds)
    assert costs.estimate(3) == pytest.approx(0.012) and costs.estimate(4) == pytest.approx(0.013)
    assert costs.estimate(9) == pytest.approx(0.018)  # along the last two
    costs.observe(6, 0.005)  # noise: fewer seconds for more rows
    assert costs.estimate(6) >= costs.estimate(5)


def test_acceptance_counts_matches_until_the_first_miss():
    acceptance = Acceptance()
    acceptance.observe([4, 5, 6], [4, 5, 9])  # two accepted, then a rejection
    assert (acceptance.accepted, acceptance.rejected) == pytest.approx((0.9 + 2, 0.9 + 1))
    acceptance.observe([4, 5], [4])  # one accepted, the rest unknown: no rejection
    assert acceptance.rejected == pytest.approx((0.9 + 1) * 0.9)


@pytest.mark.parametrize("seconds_per_row, alpha, expected", [
    (0.0, 0.9, 4),     # rows cost nothing more (weights dominate): every guess pays
    (0.010, 0.9, 0),   # every row costs a whole step: none does
    (0.001, 0.05, 0),  # cheap rows, guesses that always fail: none
    (0.002, 0.6, 2),   # in between: the likelier first guesses only
])
def test_guesses_are_added_while_they_raise_tokens_per_second(seconds_per_row, alpha, expected):
    costs = StepCosts()
    for rows in (1, 2, 3, 4, 5):
        costs.observe(rows, 0.010 + seconds_per_row * (rows - 1))
    choice = choose_guesses([Candidate("a", 4, alpha)], base_rows=1, n_decoding=1, target=costs)
    assert choice.counts.get("a", 0) == expected


def test_many_sequences_make_guesses_dear(llama):
    """At 32 decoding sequences, rows cost what they cost once arithmetic dominates: a mediocre guess is dropped
    there that would be taken at batch 1."""
    costs = StepCosts()
    for rows, seconds in ((1, 0.010), (5, 0.012), (32, 0.040), (64, 0.075)):
        costs.observe(rows, seconds)
    candidate = [Candidate("a", 4, 0.5)]
    assert choose_guesses(candidate, base_rows=1, n_decoding=1, target=costs).counts
    crowd = [Candidate(str(i), 4, 0.5) for i in range(32)]
    assert not choose_guesses(crowd, base_rows=32, n_decoding=32, target=costs).counts


class FixedCosts(StepCosts):
    """A machine where a step costs 10 ms and each more row 4 ms, whatever the steps measure."""

    def __init__(self) -> None:
        super().__init__()
        for rows in range(1, 9):
            super().observe(rows, 0.010 + 0.004 * (rows - 1))

    def observe(self, rows: int, seconds: float) -> None:
        pass


def _with_fixed_costs(model, prompt, params):
    llm = LLM(model, n_ctx=256, max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.engine.speculator.costs = FixedCosts()
    return llm.generate([prompt], params, use_tqdm=False)[0], llm.engine.speculator.stats


def test_guesses_that_fail_are_soon_no_longer_verified(llama, monkeypatch):
    monkeypatch.setattr(speculator_module, "propose_ngram", lambda tokens, *args, **kwargs: [3, 3, 3, 3])
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    output, stats = _with_fixed_costs(llama, [1, 40, 41, 42, 43], params)
    assert output.token_ids == _outputs(llama, [[1, 40, 41, 42, 43]], params)[0][0].token_ids
    assert 3 not in output.token_ids  # (so every guess was wrong)
    assert stats.num_drafts <= 2  # of 59 steps: a first guess (alpha starts at 0.5), then none


def test_guesses_that_are_right_keep_being_verified(llama, monkeypatch):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected, _ = _outputs(llama, [REPEATING], params)
    right = expected[0].token_ids

    def oracle(tokens, *args, **kwargs):
        done = len(tokens) - len(REPEATING)
        return right[done : done + 4]

    monkeypatch.setattr(speculator_module, "propose_ngram", oracle)
    output, stats = _with_fixed_costs(llama, REPEATING, params)
    assert output.token_ids == right
    assert stats.num_accepted_tokens == stats.num_draft_tokens and stats.num_drafts <= 20  # 4 more tokens a step


def test_room_for_guesses_in_the_sliding_pool(tmp_path):
    """An iSWA engine keeps k more positions per sequence in its sliding pool (so rejected guesses never cost cells
    still needed): the pool is that much larger."""
    model = exact_model(_random_gguf("gemma3", tmp_path))
    sizes = [Engine(model, n_ctx=256, max_num_seqs=2, max_num_batched_tokens=64, enable_prefix_caching=False,
                    speculative_config=speculative).context.memory.pools[1].n_cells
             for speculative in (None, {"method": "ngram", "num_speculative_tokens": 6})]
    assert sizes[1] - sizes[0] == 6 * 3  # per sequence, for the 3 sequences (2 + the prefix cache's)


def test_acceptance_tracking_does_not_depend_on_the_batch():
    """A proposal compared with what was emitted, whether or not the step verified it."""
    acceptance = Acceptance()
    acceptance.observe([1, 2, 3], [1])  # shadow: one guess seen right, nothing more known
    assert acceptance.alpha > 0.5
    assert np.isclose(Acceptance().alpha, 0.5)


def test_guesses_withdrawn_for_want_of_cells_are_not_counted():
    """When the memory cannot take a step's guesses the engine runs the step without them: nothing verified."""
    from types import SimpleNamespace

    from kvlm.speculative.speculator import Speculator
    from kvlm.speculative.stats import SpecStats

    speculator = Speculator(SpeculativeConfig.parse(NGRAM))
    request = SimpleNamespace(request_id="a", token_ids=REPEATING, finished=False, seq_id=1, speculation=SpecStats())
    guesses = speculator.guesses([(request, 4)], base_rows=1, n_decoding=1, budget=100)
    assert guesses["a"] == [5, 6, 7, 8]  # (REPEATING ends 9, 10, 11, 12: their first occurrence is followed by these)
    speculator.withdraw()
    speculator.settle(request, [5])
    assert speculator.stats.num_drafts == 0 and request.speculation.num_drafts == 0
