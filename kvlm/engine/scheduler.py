"""Who runs in the next engine step, and with how many tokens.

Each step is one batch: first one decode token for every running request that is past its prompt,
then prompt chunks (running requests first, then newly admitted ones, oldest first) until the token
budget is spent, so a long prompt never stalls the others (chunked prefill). Admission is bounded by
max_num_seqs and by free cells; when cells run out mid-generation the most recently admitted request
is preempted: its cells are freed and it is recomputed later from its prompt and output so far.

With the "priority" policy (vLLM's --scheduling-policy priority) requests wait and are preempted in the order of
their `priority` (lower first), then of arrival; a waiting request that outranks a running one, with no sequence or
no cells left for it, preempts the lowest-ranked running request.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvlm.core.errors import CacheError
from kvlm.engine.prefix_cache import PrefixCache
from kvlm.engine.prefix_tiers import PrefixTiers, TierHit
from kvlm.engine.request import Request, RequestState
from kvlm.engine.state_checkpoints import StateCheckpoints
from kvlm.memory.protocol import Memory
from kvlm.memory.seq_state import StateError

POLICIES = ("fcfs", "priority")


def rank(request: Request) -> tuple[int, float]:
    """A request's place under the priority policy: lower runs first."""
    return request.priority, request.arrival_time


@dataclass
class Scheduled:
    request: Request
    n_tokens: int
    guesses: list[int] = field(default_factory=list)  # speculative decoding: tokens to verify after the chunk
    checkpoint: object = None  # the memory's checkpoint of the sequence before the guesses (recurrent states)
    first_output: int = 0  # the row of the step's logits (and states) its first output row has

    @property
    def outputs(self) -> bool:
        """Does this chunk reach the end of what the request holds, so its last token gives logits?"""
        return self.n_tokens == self.request.n_pending


class Scheduler:
    def __init__(self, memory: Memory, prefix_cache: PrefixCache | None, max_num_seqs: int,
                 max_num_batched_tokens: int, first_seq_id: int,
                 on_release: Callable[[Request], None] | None = None,
                 checkpoints: StateCheckpoints | None = None, tiers: PrefixTiers | None = None,
                 policy: str = "fcfs") -> None:
        """`on_release(request)`: called when a request gives up its sequence (finished or preempted).
        `checkpoints`: a memory with recurrent states reuses prefixes through copies of them (and its K/V cells
        through `prefix_cache`, if it has any). `tiers`: finished sequences' states in RAM and on disk, loaded where
        they give a prompt more than the cell pool holds."""
        if policy not in POLICIES:
            raise ValueError(f"the scheduling policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.memory, self.policy = memory, policy
        self.on_release = on_release
        self.prefix_cache = prefix_cache
        self.checkpoints = checkpoints
        self.tiers = tiers
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first (fcfs)
        self.free_seq_ids = list(range(first_seq_id + max_num_seqs - 1, first_seq_id - 1, -1))
        self.n_preemptions = 0

    def add(self, request: Request) -> None:
        self._wait(request)

    def _wait(self, request: Request, front: bool = False) -> None:
        """fcfs: at the back, or at the front (preempted); priority: in rank order."""
        if self.policy == "priority":
            at = next((i for i, other in enumerate(self.waiting) if rank(other) > rank(request)), len(self.waiting))
            self.waiting.insert(at, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        """The next step's work; cells for all of it are free when this returns (evicting or preempting)."""
        self._admit()
        while True:
            plan = self._plan()
            needed = sum(s.n_tokens for s in plan)
            if self.has_room(needed) or not self.running:
                return plan
            self.preempt(self._victim())

    def finish(self, request: Request, reason: str) -> None:
        """Release a request's sequence; its computed full blocks stay behind in the prefix cache."""
        request.state, request.finish_reason = RequestState.FINISHED, reason
        request.finish_time = time.perf_counter()
        if request in self.running:
            self.running.remove(request)
            self._release(request, keep_in_cache=True)
        elif request in self.waiting:
            self.waiting.remove(request)

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request, keep_in_cache=False)
        request.state, request.n_computed = RequestState.WAITING, 0
        if request.pooler is not None:  # its prompt's states are computed again, from the start
            request.pooler.reset()
        request.n_preemptions += 1
        self.n_preemptions += 1
        self._wait(request, front=True)

    def _victim(self) -> Request:
        """The running request preempted first: the last admitted, or the lowest-ranked under priority."""
        return max(self.running, key=rank) if self.policy == "priority" else self.running[-1]

    def cache_computed_prefix(self, request: Request) -> None:
        computed = request.token_ids[: request.n_computed]
        if self.prefix_cache is not None:
            self.prefix_cache.insert(computed, request.seq_id)
        if self.checkpoints is not None:
            self.checkpoints.keep(computed, request.seq_id)

    def _admit(self) -> None:
        for request in list(self.waiting):
            if not request.ready:  # its grammar still compiles: the requests behind it go first
                continue
            while not self._admitted(request):
                if not self._outranks_a_running(request):
                    return
                self.preempt(self._victim())

    def _admitted(self, request: Request) -> bool:
        """Admit it if a sequence and its cells are free."""
        if len(self.running) >= self.max_num_seqs:
            return False
        # The cached prefix first: its cells are lent, not taken, and are not evicted to make room. Then room
        # for the rest of the prompt and one token more, so admission rarely ends in preemption.
        request.seq_id = self.free_seq_ids[-1]
        self._reuse_cached_prefix(request)
        if not self.has_room(request.n_pending + 1) and self.running:
            self.memory.seq_rm(request.seq_id, -1, -1)  # the lent cells back: it waits as it was
            request.seq_id, request.n_computed, request.n_cached_tokens = None, 0, 0
            return False
        self.waiting.remove(request)
        self.free_seq_ids.pop()
        request.state = RequestState.RUNNING
        self.running.append(request)
        return True

    def _outranks_a_running(self, request: Request) -> bool:
        return self.policy == "priority" and bool(self.running) and rank(self._victim()) > rank(request)

    def _reuse_cached_prefix(self, request: Request) -> None:
        if request.pooler is not None and not request.pooler.reuses_prefix:
            return  # its pooling reads states of every token
        n_cached = self._reuse_from_pool(request)
        if self.tiers is not None:
            n_cached = self._load_from_tiers(request, n_cached)
        request.n_computed = request.n_cached_tokens = n_cached

    def _reuse_from_pool(self, request: Request) -> int:
        if self.checkpoints is not None:
            return self._restore_checkpoint(request)
        if self.prefix_cache is not None:
            return self.prefix_cache.lend(self.prefix_cache.match(request.token_ids), request.seq_id)
        return 0

    def _load_from_tiers(self, request: Request, n_cached: int) -> int:
        """A tier's entry in place of what the pool lent, where it gives a block of the prompt or more beyond it
        (computing less than a block costs less than loading a whole sequence's state; the last token is left to
        compute); the pool's prefix again if it cannot be loaded."""
        hit, data = self._tier_hit(request, n_cached), None
        while hit is not None:
            data = self.tiers.read(hit)
            if data is not None:
                break
            hit = self._tier_hit(request, n_cached)  # (that one was unsound, and is deleted: the next)
        if hit is None:
            return n_cached
        seq_id = request.seq_id
        self.memory.seq_rm(seq_id, -1, -1)
        try:
            if not self.has_room(len(hit.entry.tokens)):
                return self._reuse_from_pool(request)
            self.memory.state_seq_load(data, seq_id)
        except StateError as exc:
            self.tiers.drop(hit, exc)
            return self._reuse_from_pool(request)
        except CacheError:  # no room after all: nothing was loaded
            return self._reuse_from_pool(request)
        if hit.n_tokens < len(hit.entry.tokens) and not self.memory.seq_rm(seq_id, hit.n_tokens, -1):
            self.memory.seq_rm(seq_id, -1, -1)  # (a sliding window cut short: not usable)
            return self._reuse_from_pool(request)
        self.tiers.loaded(hit)
        return hit.n_tokens

    def _restore_checkpoint(self, request: Request) -> int:
        """The deepest kept state inside the prompt whose K/V cells (if the memory has any) are cached too."""
        tokens = request.token_ids
        blocks = self.prefix_cache.match(tokens) if self.prefix_cache is not None else None
        limit = len(tokens) - 1 if blocks is None else len(blocks) * self.prefix_cache.block_size
        checkpoint = self.checkpoints.deepest(tokens, limit)
        if checkpoint is None:
            return 0
        if blocks is not None:
            self.prefix_cache.lend(blocks[: checkpoint.n_tokens // self.prefix_cache.block_size], request.seq_id)
        return self.checkpoints.restore(checkpoint, request.seq_id)

    def _tier_hit(self, request: Request, n_cached: int) -> TierHit | None:
        hit = self.tiers.find(request.token_ids, len(request.token_ids) - 1)
        return hit if hit is not None and hit.n_tokens - n_cached >= self.tiers.block_size else None

    def _save_to_tiers(self, request: Request) -> None:
        """The finished sequence's state, if it holds exactly its computed tokens (no guesses beyond them); and with
        recurrent states, its state at the prompt's last kept block boundary too: a next prompt that carries
        another reply than the one computed shares the prompt alone, and a state cannot be cut back to it."""
        n, seq_id = request.n_computed, request.seq_id
        if self.tiers is None or n < self.tiers.block_size or self.memory.seq_pos_max(seq_id) != n - 1:
            return
        self.tiers.save(request.token_ids[:n], lambda: self.memory.state_seq_save(seq_id))
        prompt = request.prompt_token_ids
        copy = self.checkpoints.deepest(prompt, len(prompt) - 1) if self.checkpoints is not None else None
        if copy is not None and copy.n_tokens < n:
            def state_at_copy() -> bytes:
                self.checkpoints.restore(copy, seq_id)  # (the sequence is being released: it may go back)
                return self.memory.state_seq_save(seq_id)

            self.tiers.save(prompt[: copy.n_tokens], state_at_copy)

    def _plan(self) -> list[Scheduled]:
        budget = self.max_num_batched_tokens
        plan = []
        running = sorted(self.running, key=rank) if self.policy == "priority" else self.running  # the budget too
        decoding = [r for r in running if r.n_pending == 1]
        prefilling = [r for r in running if r.n_pending > 1]
        for request in decoding + prefilling:
            n_tokens = min(request.n_pending, budget)
            if n_tokens == 0:
                break
            if self.checkpoints is not None:
                n_tokens = self.checkpoints.prompt_chunk(request.n_computed, n_tokens, len(request.token_ids))
            plan.append(Scheduled(request, n_tokens))
            budget -= n_tokens
        return plan

    def has_room(self, n_tokens: int) -> bool:
        """Whether n_tokens more tokens fit in the memory, after evicting cached prefixes if they do not."""
        if self.prefix_cache is not None:
            self.prefix_cache.evict_until(lambda: self.memory.cells_short(n_tokens) == 0)
        return self.memory.cells_short(n_tokens) == 0

    def _release(self, request: Request, keep_in_cache: bool) -> None:
        if keep_in_cache:
            self.cache_computed_prefix(request)
            if request.pooler is None:  # (an embedding's prompt is no conversation to come back to)
                self._save_to_tiers(request)
        if self.checkpoints is not None:
            self.checkpoints.forget(request.seq_id)
        if self.on_release is not None:
            self.on_release(request)
        self.memory.seq_rm(request.seq_id, -1, -1)
        self.free_seq_ids.append(request.seq_id)
        request.seq_id = None
