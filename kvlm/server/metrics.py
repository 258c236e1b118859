"""Prometheus metrics of the server, kept in a registry of its own (one per app, so tests can run several)."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvlm.engine.engine import Engine
from kvlm.engine.request import RequestOutput, StepEvent
from kvlm.server.async_engine import StepObserver
from kvlm.server.kv_report import recurrent_part
from kvlm.speculative.stats import SpecStats

log = logging.getLogger("kvlm")

SPEC_LOG_INTERVAL_S = 10.0  # as vLLM's periodic SpecDecoding metrics line
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)


class ServerMetrics(StepObserver):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvlm_requests", "Requests finished, by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvlm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvlm_generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram("kvlm_time_to_first_token_seconds", "From arrival to the first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("kvlm_inter_token_latency_seconds",
                                             "Between two tokens of the same request", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.running = Gauge("kvlm_requests_running", "Requests holding a sequence", registry=r)
        self.waiting = Gauge("kvlm_requests_waiting", "Requests waiting for a sequence", registry=r)
        # 0 for a memory without KV cells (a model of recurrent layers only)
        self.kv_cells_used = Gauge("kvlm_kv_cells_used", "KV cells in use (cached prefixes included)", registry=r)
        self.kv_cells_total = Gauge("kvlm_kv_cells_total", "KV cells in all", registry=r)
        # per pool of the memory: "kv" for the unified cache, "full" and "sliding" for iSWA
        self.kv_pool_cells_used = Gauge("kvlm_kv_pool_cells_used", "KV cells in use, by pool", ["pool"], registry=r)
        self.kv_pool_cells_total = Gauge("kvlm_kv_pool_cells_total", "KV cells in all, by pool", ["pool"],
                                         registry=r)
        # one slot per sequence id for models with recurrent layers (hybrid and recurrent memories); else 0
        self.recurrent_slots_used = Gauge("kvlm_recurrent_slots_used", "Recurrent state slots in use", registry=r)
        self.recurrent_slots_total = Gauge("kvlm_recurrent_slots_total", "Recurrent state slots in all", registry=r)
        self.state_copies = Gauge("kvlm_prefix_state_copies", "Copies of recurrent states kept for prefix reuse",
                                  registry=r)
        self.state_copy_bytes = Gauge("kvlm_prefix_state_copy_bytes", "Bytes of those copies", registry=r)
        self.prefix_hits = Counter("kvlm_prefix_cache_hits", "Requests that reused a cached prompt prefix",
                                   registry=r)
        self.prefix_hit_tokens = Counter("kvlm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                         registry=r)
        # the prefix cache's tiers beyond the cells (--prefix-cache-ram, --prefix-cache-dir), by tier
        self.tier_queries = Counter("kvlm_prefix_tier_queries", "Prompts looked up in a prefix cache tier", ["tier"],
                                    registry=r)
        self.tier_hits = Counter("kvlm_prefix_tier_hits", "Prompts that loaded a tier's entry", ["tier"], registry=r)
        self.tier_hit_tokens = Counter("kvlm_prefix_tier_hit_tokens", "Prompt tokens loaded from a tier", ["tier"],
                                       registry=r)
        self.tier_bytes = Gauge("kvlm_prefix_tier_bytes", "Bytes of the entries a tier holds", ["tier"], registry=r)
        self.tier_entries = Gauge("kvlm_prefix_tier_entries", "Entries a tier holds", ["tier"], registry=r)
        self._tier_seen: dict[str, tuple[int, int, int]] = {}
        # structured output: what compiling grammars and masking tokens cost, and how many requests were constrained
        self.grammar_compile_seconds = Counter("kvlm_grammar_compile_seconds", "Time spent compiling grammars",
                                               registry=r)
        self.grammar_mask_seconds = Counter("kvlm_grammar_mask_seconds", "Time the step loop spent on token masks",
                                            registry=r)
        self.grammar_masks = Counter("kvlm_grammar_masks", "Token masks computed (one per constrained token)",
                                     registry=r)
        self.constrained_requests = Counter("kvlm_constrained_requests", "Requests with an output constraint",
                                            registry=r)
        self._structured_totals = (0.0, 0.0, 0)
        # speculative decoding (vLLM's spec_decode_* names): verification rounds, guesses verified and accepted
        self.spec_drafts = Counter("kvlm_spec_decode_num_drafts", "Verification rounds (a request's guesses in a step)",
                                   registry=r)
        self.spec_draft_tokens = Counter("kvlm_spec_decode_num_draft_tokens", "Guessed tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("kvlm_spec_decode_num_accepted_tokens", "Guessed tokens accepted",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("kvlm_spec_decode_num_accepted_tokens_per_pos",
                                             "Guessed tokens accepted, by position in the guess", ["position"],
                                             registry=r)
        self._spec_seen = SpecStats()
        self._spec_logged = (0.0, 0)
        self._last_token_time: dict[str, float] = {}

    def on_step(self, engine: Engine, events: list[StepEvent], now: float) -> None:
        for event in events:
            if not event.new_token_ids:
                continue
            n = len(event.new_token_ids)
            self.generation_tokens.inc(n)
            last = self._last_token_time.get(event.request_id)
            if last is None:
                request = engine.requests[event.request_id]
                if request.grammar is not None:
                    self.constrained_requests.inc()
                self.time_to_first_token.observe(now - request.arrival_time)
                if request.n_cached_tokens:
                    self.prefix_hits.inc()
                    self.prefix_hit_tokens.inc(request.n_cached_tokens)
            else:
                self.inter_token_latency.observe((now - last) / n)
            self._last_token_time[event.request_id] = now
        self._count_structured(engine)
        if engine.speculator is not None:
            self._count_speculation(engine.speculator.stats, now)
        scheduler, memory = engine.scheduler, engine.context.memory
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_cells_used.set(memory.n_used if memory.pools else 0)  # a recurrent memory's n_used counts slots
        self.kv_cells_total.set(memory.n_cells if memory.pools else 0)
        for pool in memory.pools:
            self.kv_pool_cells_used.labels(pool=pool.name).set(pool.n_used)
            self.kv_pool_cells_total.labels(pool=pool.name).set(pool.n_cells)
        slots = recurrent_part(memory)
        if slots is not None:
            self.recurrent_slots_used.set(slots.n_used)
            self.recurrent_slots_total.set(slots.n_seq_max)
        if engine.checkpoints is not None:
            self.state_copies.set(engine.checkpoints.n_states)
            self.state_copy_bytes.set(engine.checkpoints.n_bytes)
        if engine.tiers is not None:
            self._count_tiers(engine.tiers.tiers)

    def _count_tiers(self, tiers) -> None:
        for tier in tiers:
            stats = tier.stats
            totals = (stats.queries, stats.hits, stats.hit_tokens)
            before = self._tier_seen.get(tier.name, (0, 0, 0))
            for counter, now, then in zip((self.tier_queries, self.tier_hits, self.tier_hit_tokens), totals, before):
                child = counter.labels(tier=tier.name)  # (shown from the start, at 0)
                if now > then:
                    child.inc(now - then)
            self._tier_seen[tier.name] = totals
            self.tier_bytes.labels(tier=tier.name).set(tier.n_bytes)
            self.tier_entries.labels(tier=tier.name).set(len(tier.entries))

    def _count_structured(self, engine: Engine) -> None:
        """The engine keeps running totals; the counters get what they added since the last step."""
        totals = (engine.grammars.compile_seconds, engine.step_masks.mask_seconds, engine.step_masks.n_masks)
        for counter, now, before in zip((self.grammar_compile_seconds, self.grammar_mask_seconds, self.grammar_masks),
                                        totals, self._structured_totals):
            if now > before:
                counter.inc(now - before)
        self._structured_totals = totals

    def _count_speculation(self, stats: SpecStats, now: float) -> None:
        seen = self._spec_seen
        self.spec_drafts.inc(stats.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_pos):
            before = seen.accepted_per_pos[position] if position < len(seen.accepted_per_pos) else 0
            self.spec_accepted_per_pos.labels(position=str(position)).inc(count - before)
        self._spec_seen = SpecStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                                    list(stats.accepted_per_pos))
        last_time, last_drafts = self._spec_logged
        if now - last_time >= SPEC_LOG_INTERVAL_S and stats.num_drafts > last_drafts:
            log.info("speculative decoding: mean acceptance length %.2f, accepted %d of %d guessed tokens (%.1f%%), "
                     "per position %s", stats.mean_acceptance_length, stats.num_accepted_tokens,
                     stats.num_draft_tokens, 100.0 * stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
                     ", ".join(f"{value:.2f}" for value in stats.to_json()["acceptance_per_position"]))
            self._spec_logged = (now, stats.num_drafts)

    def on_finished(self, output: RequestOutput) -> None:
        self.requests.labels(finish_reason=output.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self._last_token_time.pop(output.request_id, None)

    def refresh(self, engine: Engine) -> None:
        """Gauges as they are now, for a scrape while the engine is idle."""
        self.on_step(engine, [], 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
