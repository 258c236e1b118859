"""The token masks of one engine step: one int32 bitmask row per constrained request, filled in one call.

llguidance fills the rows on its own thread without the GIL; each row goes to its request's sampler as a
`TokenMask`. Unconstrained requests get no row (nothing to mask).
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

from kvlm.structured.compiler import GrammarCompiler
from kvlm.structured.request_grammar import TokenMask


class StepMasks:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self._compiler = compiler
        self._bitmask = allocate_token_bitmask(1, compiler.vocab_size)
        self.mask_seconds = 0.0  # summed over steps: what constraints cost the step loop
        self.n_masks = 0

    def fill(self, requests: Sequence) -> dict[str, TokenMask]:
        """request_id -> the tokens its grammar allows next, for requests whose grammar is active."""
        start = time.perf_counter()
        if self._bitmask.shape[0] < len(requests):
            self._bitmask = allocate_token_bitmask(len(requests), self._compiler.vocab_size)
        matchers = [(request.grammar.matcher, row) for row, request in enumerate(requests)]
        fill_next_token_bitmask_par(self._compiler.executor, matchers, self._bitmask[: len(requests)])
        vocab = self._compiler.vocab_size
        allowed = {request.request_id: TokenMask(self._bitmask[row], vocab) for row, request in enumerate(requests)}
        self.mask_seconds += time.perf_counter() - start
        self.n_masks += len(requests)
        return allowed
