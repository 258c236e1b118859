"""The engine loop: schedule a step, run it as one batch through Context.decode, sample, stream out."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from kvlm.core.batch import Batch
from kvlm.core.staging import staged
from kvlm.runtime.context import Context, DecodeStatus
from kvlm.engine.pooling import Pooler
from kvlm.engine.prefix_cache import PrefixCache
from kvlm.engine.prefix_tiers import PrefixTiers, fingerprint
from kvlm.engine.state_checkpoints import StateCheckpoints, checkpoint_capacity
from kvlm.engine.request import Request, RequestOutput, RequestState, StepEvent
from kvlm.sampling.batch import Row, sample_rows
from kvlm.sampling.sampler import RequestSampler, SampledToken
from kvlm.sampling.params import SamplingParams
from kvlm.engine.scheduler import Scheduled, Scheduler
from kvlm.engine.stop import StopChecker
from kvlm.core.errors import KvlmError
from kvlm.loader.load import Model, plan_for_loaded
from kvlm.loader.memory_plan import MemoryRequest
from kvlm.memory.kv_store import AUTO, resolve_kv_dtype
from kvlm.speculative.config import SpeculativeConfig
from kvlm.speculative.speculator import Speculator, make_speculator
from kvlm.structured.compiler import GrammarCompiler, GrammarError
from kvlm.structured.request_grammar import RequestGrammar, TokenMask
from kvlm.structured.step_masks import StepMasks

log = logging.getLogger("kvlm")

DEFAULT_DISK_TIER = 10 * 2**30  # bytes of the disk tier when only its directory is given
PREFIX_CACHE_SEQ = 0  # the sequence id that keeps cached prefixes alive; requests use 1..max_num_seqs


class EngineError(KvlmError):
    """The engine could not run a step (a decode failed for a reason other than lack of room)."""


def memory_request(n_ctx: int | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                   kv_dtype: str = AUTO, enable_prefix_caching: bool = True, block_size: int = 16,
                   swa_full: bool = False, speculative_tokens: int = 0) -> MemoryRequest:
    """What an engine of these settings asks of a model's memory: its Context's sizes (one more sequence for the
    prefix cache; a block's worth of positions kept beyond a sliding window, and room for guessed tokens), and the
    copies of recurrent states prefix caching keeps (none where the model has no recurrent layers)."""
    return MemoryRequest(n_ctx, max_num_seqs + 1, kv_dtype, max_num_batched_tokens, swa_full,
                         _keep_extra(enable_prefix_caching, block_size, speculative_tokens),
                         checkpoint_capacity(max_num_seqs) if enable_prefix_caching else 0)


def _keep_extra(enable_prefix_caching: bool, block_size: int, speculative_tokens: int) -> int:
    """Positions a sequence keeps beyond its sliding window: a prefix-cache block (so a cached conversation ends
    with a whole window), and the guesses of one step (so verifying them never frees cells still needed once they
    are rejected)."""
    return (block_size - 1 if enable_prefix_caching else 0) + speculative_tokens


class Engine:
    def __init__(self, model: Model, n_ctx: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, kv_dtype: str = AUTO, enable_prefix_caching: bool = True,
                 block_size: int = 16, swa_full: bool = False, memory_budget: int | None = None,
                 speculative_config: SpeculativeConfig | dict | str | None = None, enforce_eager: bool = False,
                 prefix_cache_ram: int = 0, prefix_cache_dir: str | None = None,
                 prefix_cache_disk: int = DEFAULT_DISK_TIER, scheduling_policy: str = "fcfs") -> None:
        """`n_ctx` None: the largest that fits in memory, up to the model's own context length; a context that does
        not fit is refused (MemoryPlanError) before it is allocated. `speculative_config`: vLLM's (see
        kvlm.speculative.config); guesses are verified in the step's batch, exactly. `enforce_eager` (vLLM's): no
        CUDA graphs for decode steps on a GPU (kvlm.model.cuda_graphs). With prefix caching, `prefix_cache_ram`
        bytes of finished sequences' states kept in RAM and `prefix_cache_disk` bytes in `prefix_cache_dir`
        (kvlm.engine.prefix_tiers); 0 / None: no such tier. `scheduling_policy`: "fcfs", or "priority" (vLLM's:
        requests run in the order of their priority, lower first, preempting lower-ranked ones; see Scheduler)."""
        self.model = model
        speculative_config = SpeculativeConfig.parse(speculative_config)
        k = speculative_config.num_speculative_tokens if speculative_config else 0
        request = memory_request(n_ctx, max_num_seqs, max_num_batched_tokens, kv_dtype, enable_prefix_caching,
                                 block_size, swa_full, k)
        self.plan = plan_for_loaded(model, request, memory_budget)
        n_ctx = self.plan.n_ctx
        kv_dtype = resolve_kv_dtype(kv_dtype, model.decoder.dtype, model.decoder.quantized)
        self.context = Context(model, n_ctx=n_ctx, n_batch=max_num_batched_tokens,
                               n_ubatch=max_num_batched_tokens, n_seq_max=max_num_seqs + 1, kv_dtype=kv_dtype,
                               swa_full=swa_full, swa_keep_extra=request.keep_extra,
                               cuda_graphs=False if enforce_eager else None)
        memory = self.context.memory
        self.prefix_cache = PrefixCache(memory, PREFIX_CACHE_SEQ, block_size) \
            if enable_prefix_caching and memory.pools else None
        self.checkpoints = StateCheckpoints(memory, block_size, request.state_checkpoints) \
            if enable_prefix_caching and memory.kind in ("recurrent", "hybrid") else None
        self.tiers = None
        if enable_prefix_caching and (prefix_cache_ram or prefix_cache_dir):
            self.tiers = PrefixTiers(fingerprint(model, kv_dtype), prefix_cache_ram, prefix_cache_dir,
                                     prefix_cache_disk, partial=self.checkpoints is None, block_size=block_size)
        self.speculator: Speculator | None = None
        if speculative_config is not None:
            self.speculator = make_speculator(speculative_config, model, n_ctx, max_num_seqs + 1,
                                              max_num_batched_tokens, memory_budget)
            self.speculator.calibrate(self.context, PREFIX_CACHE_SEQ + 1)
        self.scheduler = Scheduler(memory, self.prefix_cache, max_num_seqs, max_num_batched_tokens,
                                   first_seq_id=PREFIX_CACHE_SEQ + 1,
                                   on_release=self.speculator.forget if self.speculator else None,
                                   checkpoints=self.checkpoints, tiers=self.tiers, policy=scheduling_policy)
        self.requests: dict[str, Request] = {}
        # structured output: compiled off the step loop (the vocabulary's trie is built at the first use)
        self.grammars = GrammarCompiler(model.tokenizer, model.config.vocab_size)
        self.step_masks = StepMasks(self.grammars)
        self._ids = itertools.count()
        self.n_prefill_tokens = 0  # prompt tokens actually run through the model (cache hits excluded)
        # Where the logits stay on a GPU, a step's rows are sampled there at once (kvlm.sampling.batch) and only
        # their ids come back; on the CPU each request's sampler takes its row (its fast paths need no sort).
        self.batched_sampling = self.context.logits_device.type != "cpu"

    @property
    def n_ctx(self) -> int:
        return self.context.n_ctx

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    reasoning_ended: Callable[[str], int | None] | None = None, pooling: str | None = None,
                    priority: int = 0) -> str:
        """`reasoning_ended(output_text)`, for a model that may reason before it answers: where the answer starts
        in the output so far (None while it may still be reasoning); a structured-output constraint then applies
        only to the answer (see RequestGrammar). `pooling` ("last", "mean", "cls"; kvlm.engine.pooling): an
        embedding request, which computes its prompt and ends with its pooled vector (RequestOutput.embedding),
        generating nothing; batched with the others. `priority`: its rank under the priority policy (lower first);
        other than 0 it needs that policy (ValueError, as vLLM)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_priority(priority)
        tokenizer = self.model.tokenizer
        grammar = None
        if params.structured_outputs is not None:
            grammar = RequestGrammar(self.grammars.submit(params.structured_outputs), self.grammars, reasoning_ended)
        request = Request(request_id, list(prompt_token_ids), params,
                          RequestSampler(params, list(prompt_token_ids)),
                          StopChecker(tokenizer, params, tokenizer.stop_ids), grammar,
                          pooler=Pooler(pooling) if pooling is not None else None, priority=priority)
        self.requests[request_id] = request
        problem = self._unfit(request)
        if problem:
            request.error = problem
            request.state, request.finish_reason = RequestState.FINISHED, "error"
        else:
            self.scheduler.add(request)
        return request_id

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.scheduler.policy != "priority":
            raise ValueError(f"priority {priority} needs the priority scheduling policy (--scheduling-policy "
                             "priority); this engine schedules first come, first served")

    def _unfit(self, request: Request) -> str | None:
        n_prompt, vocab = len(request.prompt_token_ids), self.model.config.vocab_size
        if n_prompt == 0:
            return "the prompt is empty: at least one token is needed"
        if n_prompt + 1 > self.n_ctx:
            return f"the prompt has {n_prompt} tokens; with one generated token that exceeds n_ctx = {self.n_ctx}"
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
        biased = sorted(t for t in request.params.logit_bias or {} if t >= vocab)
        if biased:  # found here, not at the first sample, where it would fail the whole step
            return f"logit_bias token id {biased[0]} is outside the vocabulary [0, {vocab})"
        return None

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")
            request.stop.finish()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def release(self, request_id: str) -> RequestOutput:
        """The final output of a finished request, forgotten by the engine afterwards."""
        return RequestOutput.of(self.requests.pop(request_id))

    def step(self) -> list[StepEvent]:
        events = self._finish_full_sequences() + self._fail_bad_grammars()
        plan = self.scheduler.schedule()
        if not plan:
            self._wait_for_a_grammar()
            return events
        if self.speculator is not None:
            self._add_guesses(plan)
        batch = self._batch(plan)
        started = time.perf_counter()
        status = self.context.decode(batch, embeddings=any(item.request.pooler is not None for item in plan))
        if status != DecodeStatus.OK:
            raise EngineError(f"decode failed with {status.name}: {self.context.last_error}")
        if self.speculator is not None:  # the forward pass alone, as the calibration timed it
            self.speculator.observe_step(len(batch.tokens), time.perf_counter() - started)
        return events + self._advance(plan)

    def _add_guesses(self, plan: list[Scheduled]) -> None:
        """Guessed tokens for requests past their prompt, verified after their last token in this step's batch:
        at most as many as leave room for every token they may yield (max_tokens, the context), within the step's
        token budget and the free cells."""
        # (one pending token: a recurrent sequence that went back to before rejected guesses first catches up)
        wants = [(item, item.request) for item in plan if item.n_tokens == 1 and item.outputs
                 and item.request.output_token_ids and self._unmasked(item.request)]
        if not wants:
            return
        base_rows = sum(item.n_tokens for item in plan)
        limits = [(request, min(request.params.max_tokens - len(request.output_token_ids),
                                self.n_ctx - len(request.token_ids)) - 1) for _, request in wants]
        guesses = self.speculator.guesses(limits, base_rows, sum(item.outputs for item in plan),
                                          self.scheduler.max_num_batched_tokens - base_rows)
        if not guesses:
            return
        if not self.scheduler.has_room(base_rows + sum(map(len, guesses.values()))):
            self.speculator.withdraw()
            return
        memory = self.context.memory
        for item, request in wants:
            item.guesses = guesses.get(request.request_id, [])
            if item.guesses:
                item.checkpoint = memory.checkpoint(request.seq_id)

    def _finish_full_sequences(self) -> list[StepEvent]:
        """A request whose sequence fills the whole context cannot take another token."""
        full = [r for r in self.scheduler.running if len(r.token_ids) >= self.n_ctx and r.n_pending == 1]
        for request in full:
            self.scheduler.finish(request, "length")
        return [StepEvent(r.request_id, r.stop.finish(), [], True) for r in full]

    def _fail_bad_grammars(self) -> list[StepEvent]:
        """Requests whose constraint failed to compile end with the compiler's message."""
        failed = [r for r in self.scheduler.waiting if r.grammar is not None and r.grammar.error is not None]
        for request in failed:
            request.error = request.grammar.error
            self.scheduler.finish(request, "error")
        return [StepEvent(r.request_id, r.stop.finish(), [], True) for r in failed]

    def _wait_for_a_grammar(self) -> None:
        """Nothing could run: rather than spin, wait (briefly) for a compiling grammar."""
        compiling = next((r.grammar for r in self.scheduler.waiting if not r.ready), None)
        if compiling is not None:
            compiling.wait(timeout=0.05)

    def _batch(self, plan: list[Scheduled]) -> Batch:
        tokens, positions, seq_ids, outputs = [], [], [], []
        n_outputs = 0
        for item in plan:
            request = item.request
            start = request.n_computed
            n_rows = item.n_tokens + len(item.guesses)
            tokens += request.token_ids[start : start + item.n_tokens] + item.guesses
            positions += range(start, start + n_rows)
            seq_ids += [request.seq_id] * n_rows
            if request.pooler is not None:
                rows = request.pooler.output_rows(start, item.n_tokens, item.outputs)
            else:
                rows = [False] * (item.n_tokens - 1) + [item.outputs] + [True] * len(item.guesses)
            item.first_output, n_outputs = n_outputs, n_outputs + sum(rows)
            outputs += rows
        return Batch(tokens=tokens, pos=positions, seq_ids=seq_ids, logits=outputs)

    def _advance(self, plan: list[Scheduled]) -> list[StepEvent]:
        sampling = []  # the chunks that give their request tokens this step, in the order of the batch's logits
        pooled = []  # embedding requests whose prompt this step finished
        for item in plan:
            request = item.request
            if len(request.output_token_ids) == 0:
                self.n_prefill_tokens += item.n_tokens
            outputs = item.outputs  # (read before n_computed moves)
            if request.pooler is not None:
                rows = sum(request.pooler.output_rows(request.n_computed, item.n_tokens, outputs))
                request.pooler.add(self.context.embeddings()[item.first_output : item.first_output + rows])
            request.n_computed += item.n_tokens
            prompt_done = outputs and not request.output_token_ids
            if prompt_done:  # later requests can share the prompt now (its state copy is kept before the next)
                self.scheduler.cache_computed_prefix(request)
            if self.checkpoints is not None and not item.guesses:  # (guesses: the state holds unverified tokens)
                self.checkpoints.after_step(request.seq_id, request.n_computed)
            if outputs:
                (pooled if request.pooler is not None else sampling).append(item)
        constrained = [item.request for item in sampling if item.request.grammar is not None
                       and self._constrained(item.request)]
        allowed = self.step_masks.fill(constrained) if constrained else {}
        sampled = self._sample_at_once(sampling, allowed) if self.batched_sampling else {}
        events = [self._pooled(item.request) for item in pooled]
        for item in sampling:
            request, row = item.request, item.first_output
            if request.error is not None:  # its output broke its grammar
                self.scheduler.finish(request, "error")
                events.append(StepEvent(request.request_id, request.stop.finish(), [], True))
            elif item.guesses:
                events.append(self._verify(item, row))
            else:
                events.append(self._sample(request, row, allowed.get(request.request_id),
                                           sampled.get(request.request_id)))
            if self.speculator is not None:
                self.speculator.settle(request, events[-1].new_token_ids)
        return events

    def _pooled(self, request: Request) -> StepEvent:
        """An embedding request whose whole prompt is computed ends with its vector."""
        request.embedding = request.pooler.result()
        self.scheduler.finish(request, "stop")
        return StepEvent(request.request_id, "", [], True)

    def _sample_at_once(self, sampling: list[Scheduled], allowed: dict[str, TokenMask]) -> dict[str, SampledToken]:
        """The tokens of the step's rows that take one (not those verifying guesses, whose rows are sampled in turn
        until a guess fails), sampled together where the logits are."""
        rows, requests = [], []
        for item in sampling:
            request = item.request
            if request.error is None and not item.guesses:
                rows.append(item.first_output)
                requests.append(request)
        if not rows:
            return {}
        logits = self.context.logits()[staged(torch.tensor(rows), self.context.logits_device)]
        chosen = sample_rows(logits, [Row(r.sampler, allowed.get(r.request_id)) for r in requests])
        return {request.request_id: token for request, token in zip(requests, chosen)}

    def _verify(self, item: Scheduled, row: int) -> StepEvent:
        """Sample each row in turn with the request's own sampler, accepting guesses while the sample equals the
        guess (exactly the target's distribution: a guess is a point mass, so this is the rejection rule; the
        generator is drawn once per token, as without guesses). The cells of rejected guesses are removed."""
        request, guesses = item.request, item.guesses
        text, emitted, logprobs = "", [], []
        for i in range(len(guesses) + 1):
            sampled = request.sampler.sample(self.context.get_logits_ith(row + i))
            new_text = self._accept(request, sampled)
            text, emitted = text + new_text, emitted + [sampled.token_id]
            logprobs.append(sampled)
            if request.finished or i == len(guesses) or sampled.token_id != guesses[i]:
                break
            if not self._unmasked(request):
                break  # a lazy constraint's trigger: its mask applies from the next token, which no guess may take
            request.n_computed += 1  # the guess was right: its row in the memory is the sequence's
        if not request.finished:
            self._remove_rejected(item)
        return StepEvent(request.request_id, text, emitted, request.finished,
                         logprobs if request.params.logprobs is not None else None)

    def _remove_rejected(self, item: Scheduled) -> None:
        request, memory = item.request, self.context.memory
        if request.n_computed > memory.seq_pos_max(request.seq_id):
            return  # every guess was accepted
        if not memory.seq_rm(request.seq_id, request.n_computed, -1):  # a recurrent state: back to before the step
            memory.restore(item.checkpoint)
            request.n_computed = memory.seq_pos_max(request.seq_id) + 1  # the tokens since run again next step

    def _unmasked(self, request: Request) -> bool:
        """Whether no grammar masks the request's next token (none, or a lazy one whose trigger its output so far
        does not hold): guessed tokens may be taken."""
        return request.grammar is None or (not self._constrained(request) and request.grammar.untriggered)

    def _constrained(self, request: Request) -> bool:
        """Whether the request's grammar masks this step's token; a grammar its output broke fails it."""
        try:
            return request.grammar.active(request.stop.text, request.output_token_ids)
        except GrammarError as exc:
            request.error = str(exc)
            return False

    def _sample(self, request: Request, row: int, allowed: TokenMask | None = None,
                sampled: SampledToken | None = None) -> StepEvent:
        """The request's token from row `row` of the step's logits (`sampled`: already chosen with the others)."""
        if sampled is None:
            sampled = request.sampler.sample(self.context.get_logits_ith(row), allowed)
        new_text = self._accept(request, sampled, allowed)
        logprobs = [sampled] if request.params.logprobs is not None else None
        return StepEvent(request.request_id, new_text, [sampled.token_id], request.finished, logprobs)

    def _accept(self, request: Request, sampled: SampledToken, allowed: TokenMask | None = None) -> str:
        """Add the sampled token to the request's output; the text it completes. Ends the request where its stop
        conditions say."""
        complete = allowed is not None and request.grammar.accept(sampled.token_id)
        request.output_token_ids.append(sampled.token_id)
        request.logprobs.append(sampled)
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        result = request.stop.add(sampled.token_id)
        new_text = result.new_text
        if result.finished:
            self.scheduler.finish(request, result.finish_reason)
        elif complete:  # the grammar allows nothing more: the request ends as at a stop token
            new_text += request.stop.finish()
            self.scheduler.finish(request, "stop")
        elif len(request.output_token_ids) >= request.params.max_tokens:
            self.scheduler.finish(request, "length")
        return new_text
