"""Deciding how many guesses pay, from measured step costs and each request's acceptance.

A step that computes R rows for D decoding requests yields D tokens in T(R) seconds. Adding a request's j-th
guess costs one more row (and, for a draft model, its share of a draft step) and yields one more token with
probability alpha^j (acceptance taken as geometric: a guess counts only when all before it were accepted). Guesses
are added, most likely first, while they raise tokens per second; on text where guesses fail none are, and the
step is the step without speculation.

T is measured, not assumed: a calibration at start (one sequence's 1..k+1 rows) and then every step the engine
runs, by its row count. On a CPU the cost of rows grows slowly while weights dominate (batch 1) and about
linearly once arithmetic does (many sequences), so the same rule speculates at batch 1 and stops at batch 32.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from kvlm.speculative.stats import n_matching

SMOOTHING = 0.2      # weight of a new timing in its row count's running estimate
DECAY = 0.9          # how much of its past a request's acceptance keeps per observation
PRIOR = (1.0, 1.0)   # (accepted, rejected) pseudo-counts: a new request starts at alpha = 0.5
MAX_ALPHA = 0.98     # never quite certain: the j-th guess of a perfect record still decays
GAIN_MARGIN = 1.02   # guesses must raise a step's tokens per second by 2%, so estimation noise does not slow it


class StepCosts:
    """Seconds of a step by the number of rows it computes: running estimates, interpolated in between."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self._rows: list[int] = []
        self._floor: list[float] = []  # per known row count, the most seconds any count up to it took

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        if old is None:
            bisect.insort(self._rows, rows)
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] = old + SMOOTHING * (seconds - old)
        self._floor = list(itertools.accumulate((self.seconds[r] for r in self._rows), max))

    def estimate(self, rows: int) -> float:
        """T(rows): linear between the nearest measured counts, extended along the last two beyond them; never less
        than fewer rows took (noise aside, more rows never take less time)."""
        known = self._rows
        if not known:
            return float(rows)  # nothing measured: proportional (no guess will look free)
        if len(known) == 1:
            return self.seconds[known[0]] * max(rows / known[0], 1.0)
        below = bisect.bisect_right(known, rows)  # known counts <= rows
        i = min(max(below, 1), len(known) - 1)
        lo, hi = known[i - 1], known[i]
        value = self.seconds[lo] + (self.seconds[hi] - self.seconds[lo]) * (rows - lo) / (hi - lo)
        return max(value, self._floor[below - 1] if below else 0.0, 1e-9)


@dataclass
class Acceptance:
    """One request's record: accepted guesses and rejections, older ones weighing less."""

    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]

    @property
    def alpha(self) -> float:
        return min(self.accepted / (self.accepted + self.rejected), MAX_ALPHA)

    def observe(self, guesses: list[int], emitted: list[int]) -> None:
        """Compare a proposal with the tokens the step really emitted (whether or not they were verified): each
        matching guess is an acceptance, the first mismatch a rejection; past the emitted tokens nothing is known."""
        n_match = n_matching(guesses, emitted)
        if n_match == 0 and (not guesses or not emitted):
            return
        rejected = 1.0 if n_match < min(len(guesses), len(emitted)) else 0.0
        self.accepted = self.accepted * DECAY + n_match
        self.rejected = self.rejected * DECAY + rejected


@dataclass
class Candidate:
    """A request that could verify guesses this step: at most `limit` of them, each accepted with `alpha`."""

    key: object
    limit: int
    alpha: float


@dataclass
class Choice:
    counts: dict = field(default_factory=dict)  # key -> guesses to verify (absent: none)


def choose_guesses(candidates: list[Candidate], base_rows: int, n_decoding: int, target: StepCosts,
                   draft: StepCosts | None = None) -> Choice:
    """How many guesses each candidate verifies: added most likely first while tokens per second rise, kept only if
    in all they raise it by GAIN_MARGIN (so estimation noise does not make steps slower).

    `base_rows`: the rows the step computes anyway; `n_decoding`: the tokens it yields anyway. `draft`: the draft
    model's step costs (its j-th step computes one row per request guessing at least j tokens)."""
    options = sorted(((c.alpha ** j, j, i) for i, c in enumerate(candidates) for j in range(1, c.limit + 1)),
                     key=lambda o: (-o[0], o[1]))
    depth = [0] * len(candidates)
    per_step: list[int] = []  # draft rows per draft step
    tokens, rows = float(n_decoding), base_rows
    seconds = base_seconds = target.estimate(rows)
    for gain, j, i in options:
        if depth[i] != j - 1:  # (equal alphas may list a later guess before an earlier one of another request)
            continue
        extra = target.estimate(rows + 1) - target.estimate(rows)
        if draft is not None:
            if len(per_step) < j:
                per_step.append(0)
            n = per_step[j - 1]
            extra += draft.estimate(n + 1) - (draft.estimate(n) if n else 0.0)
        if (tokens + gain) / (seconds + extra) <= tokens / seconds:
            continue
        tokens, rows, seconds = tokens + gain, rows + 1, seconds + extra
        depth[i] = j
        if draft is not None:
            per_step[j - 1] += 1
    if tokens / seconds <= GAIN_MARGIN * n_decoding / base_seconds:
        return Choice()
    return Choice({candidates[i].key: d for i, d in enumerate(depth) if d})
