"""What the engine asks of speculative decoding each step: guesses per request, and what became of them.

The engine verifies the guesses (kvlm/engine/engine.py); this decides them: the proposer's tokens (prompt lookup
or a draft model), how many of them pay (kvlm/speculative/tuning.py, unless `adaptive` is off), and the counts
Prometheus and the timings report (vLLM's spec_decode_* names).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvlm.core.batch import Batch
from kvlm.runtime.context import Context, DecodeStatus
from kvlm.loader.load import Model, load_model
from kvlm.loader.memory_plan import MemoryRequest
from kvlm.speculative.config import SpeculativeConfig
from kvlm.speculative.draft_model import DraftModel, DraftWant
from kvlm.speculative.ngram import propose_ngram
from kvlm.speculative.stats import SpecStats, n_matching
from kvlm.speculative.tuning import Acceptance, Candidate, StepCosts, choose_guesses

CALIBRATION_REPEATS = 2
PROBE_INTERVAL = 16  # a draft model left idle this many steps for a request guesses once, to see if it pays again


@dataclass
class _Round:
    """One request's guesses in the current step."""

    n_tokens_before: int  # the target's tokens when they were made
    proposal: list[int]   # what the proposer said (prompt lookup: possibly more than was verified)
    verified: list[int]


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        self.config = config
        self.draft = draft
        self.costs = StepCosts()  # the target's step seconds by rows
        self.stats = SpecStats()
        self._acceptance: dict[str, Acceptance] = {}
        self._rounds: dict[str, _Round] = {}
        self._idle: dict[str, int] = {}

    def calibrate(self, context: Context, seq_id: int) -> None:
        """Time the target on 1, 2 and k+1 rows of one sequence (each row with logits, as verification asks), so
        the first steps already know what guesses cost; every later step refines it."""
        fastest: dict[int, float] = {}
        k = self.config.num_speculative_tokens
        for _ in range(CALIBRATION_REPEATS):
            for n in sorted({1, 2, k + 1}):  # (the costs grow about linearly past one row; steps fill in the rest)
                started = time.perf_counter()
                status = context.decode(Batch(tokens=[0] * n, pos=list(range(n)), seq_ids=[seq_id] * n,
                                              logits=[True] * n))
                seconds = time.perf_counter() - started
                context.memory.seq_rm(seq_id, -1, -1)
                if status != DecodeStatus.OK:
                    return  # (a context too small for k + 1 rows: the running estimates start from the steps)
                fastest[n] = min(fastest.get(n, seconds), seconds)
        for n, seconds in fastest.items():
            self.costs.observe(n, seconds)

    def guesses(self, wants: list[tuple[object, int]], base_rows: int, n_decoding: int,
                budget: int) -> dict[str, list[int]]:
        """Guesses for some of `wants` (request, the most it may verify), within `budget` extra rows."""
        config = self.config
        proposals: dict[str, list[int]] = {}
        candidates = []
        for request, limit in wants:
            limit = min(limit, config.num_speculative_tokens)
            if limit <= 0:
                continue
            if self.draft is None:
                proposal = propose_ngram(request.token_ids, config.prompt_lookup_min, config.prompt_lookup_max,
                                         config.num_speculative_tokens)
                proposals[request.request_id] = proposal
                limit = min(limit, len(proposal))
                if limit == 0:
                    continue
            acceptance = self._acceptance.setdefault(request.request_id, Acceptance())
            candidates.append(Candidate(request.request_id, limit, acceptance.alpha))
        counts = self._counts(candidates, base_rows, n_decoding, budget)
        if self.draft is not None:
            self._propose_with_draft([(request, counts.get(request.request_id, 0)) for request, _ in wants],
                                     proposals)
        rounds = {}
        for request, _ in wants:
            proposal = proposals.get(request.request_id, [])
            verified = proposal[: counts.get(request.request_id, 0)]
            rounds[request.request_id] = _Round(len(request.token_ids), proposal, verified)
        self._rounds = rounds
        return {key: r.verified for key, r in rounds.items() if r.verified}

    def withdraw(self) -> None:
        """The step could not take this step's guesses (no free cells): none is verified."""
        for round_ in self._rounds.values():
            round_.verified = []

    def settle(self, request, emitted: list[int]) -> None:
        """What a request's step emitted: acceptance (also of guesses the step did not verify), counts, and the
        draft's memory brought back to the target's tokens."""
        round_ = self._rounds.pop(request.request_id, None)
        if round_ is None:
            return
        if round_.verified:
            accepted = n_matching(round_.verified, emitted)
            self.stats.count(len(round_.verified), accepted)
            request.speculation.count(len(round_.verified), accepted)
        if round_.proposal and not request.finished:
            self._acceptance.setdefault(request.request_id, Acceptance()).observe(round_.proposal, emitted)
        if self.draft is not None and round_.proposal and request.seq_id is not None:
            self.draft.settle(request.seq_id, round_.n_tokens_before, round_.proposal, emitted)

    def forget(self, request) -> None:
        """The request left its sequence (finished or preempted); a step that finished it still settles after."""
        if self.draft is not None and request.seq_id is not None:
            self.draft.forget(request.seq_id)
        if request.finished:
            self._acceptance.pop(request.request_id, None)
            self._idle.pop(request.request_id, None)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.costs.observe(rows, seconds)

    def _counts(self, candidates: list[Candidate], base_rows: int, n_decoding: int, budget: int) -> dict[str, int]:
        if not self.config.adaptive:
            counts = {c.key: c.limit for c in candidates}
        else:
            draft_costs = None if self.draft is None else self.draft.costs
            counts = choose_guesses(candidates, base_rows, n_decoding, self.costs, draft_costs).counts
            if self.draft is not None:
                self._probe_idle(candidates, counts)
        for candidate in candidates:  # the step's token budget, first come first served
            count = min(counts.get(candidate.key, 0), budget)
            budget -= count
            counts[candidate.key] = count
        return counts

    def _probe_idle(self, candidates: list[Candidate], counts: dict) -> None:
        """A draft model's acceptance is only seen when it guesses: one guess now and then keeps it known."""
        for candidate in candidates:
            request_id = candidate.key
            idle = 0 if counts.get(request_id) else self._idle.get(request_id, 0) + 1
            if idle >= PROBE_INTERVAL:
                counts[request_id], idle = 1, 0
            self._idle[request_id] = idle

    def _propose_with_draft(self, counts: list[tuple[object, int]], proposals: dict[str, list[int]]) -> None:
        wanted = [(request, count) for request, count in counts if count > 0]
        if not wanted:
            return
        drafted = self.draft.propose([DraftWant(request.seq_id, request.token_ids, count)
                                      for request, count in wanted])
        for (request, _), guesses in zip(wanted, drafted):
            proposals[request.request_id] = guesses


def make_speculator(config: SpeculativeConfig, target: Model, n_ctx: int, n_seq_max: int, n_batch: int,
                    memory_budget: int | None = None) -> Speculator:
    """The speculator of an engine; a draft model is loaded (or taken, if loaded already) on the target's device with
    a context as large as the target's, its vocabulary checked against the target's."""
    if config.method != "draft_model":
        return Speculator(config)
    model = config.model
    if not isinstance(model, Model):
        model = load_model(model, memory=MemoryRequest(n_ctx, n_seq_max, n_ubatch=n_batch), memory_budget=memory_budget,
                           device=target.decoder.device)  # beside the target
    draft = DraftModel(model, target.tokenizer, target.config.vocab_size, n_ctx, n_seq_max, n_batch)
    return Speculator(config, draft)
