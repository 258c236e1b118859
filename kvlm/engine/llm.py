"""`LLM`: what most users call. Many prompts in, answers out, continuous batching underneath."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from kvlm.engine.engine import Engine, memory_request
from kvlm.engine.request import RequestOutput
from kvlm.engine.sampling_params import SamplingParams
from kvlm.loader.fetch import DEFAULT_MODEL
from kvlm.loader.load import Model, load_model
from kvlm.memory.kv_store import AUTO
from kvlm.tokenizer import checked_template_kwargs

Prompt = str | list[int]
Conversation = list[dict]


@dataclass
class StreamChunk:
    """Incremental output of `LLM.stream`: the text and token ids that are new since the last chunk."""

    text: str
    token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None  # set on the last chunk


class LLM:
    def __init__(self, model: str | Model = DEFAULT_MODEL, dtype: str = AUTO, *, quant: str | None = AUTO,
                 batch_invariant: bool = False, n_ctx: int | None = None, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, kv_dtype: str = AUTO, enable_prefix_caching: bool = True,
                 compile: bool = False, swa_full: bool = False, tensor_parallel_size: int = 1,
                 memory_budget: int | None = None) -> None:
        """`swa_full`: for models with sliding-window layers, keep every cell of those layers (more memory; a
        cached prefix is then always reusable) instead of only each sequence's window. `tensor_parallel_size` N:
        the model's heads and MLP split over N processes (this one and N - 1 it starts; see kvlm.parallel).

        `n_ctx` None is the largest context that fits in memory, up to the model's own. `memory_budget` (bytes)
        caps weights, their dense copies, the KV cache and buffers. What does not fit is refused before it is
        loaded or allocated (MemoryPlanError, each part named)."""
        request = memory_request(n_ctx, max_num_seqs, max_num_batched_tokens, kv_dtype, enable_prefix_caching,
                                 swa_full=swa_full)
        if not isinstance(model, Model):
            model = load_model(model, dtype, quant=quant, batch_invariant=batch_invariant, compile=compile,
                               tensor_parallel_size=tensor_parallel_size, memory=request, memory_budget=memory_budget)
            n_ctx = model.plan.n_ctx  # as planned before loading
        elif tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size applies when LLM loads the model; for a loaded model, pass it "
                             "to load_model")
        self.model = model
        self.tokenizer = self.model.tokenizer
        self.engine = Engine(self.model, n_ctx=n_ctx, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, kv_dtype=kv_dtype,
                             enable_prefix_caching=enable_prefix_caching, swa_full=swa_full,
                             memory_budget=memory_budget)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text (tokenized as is) or a list of token ids."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        return self._run([self._ids(p) for p in prompts], _per_prompt(params, len(prompts)), use_tqdm)

    def chat(self, conversations: Conversation | Sequence[Conversation],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Each conversation (a list of {"role", "content"}) is rendered with the model's chat template.

        As in vLLM, `tools` (OpenAI function specs) and `chat_template_kwargs` (e.g. {"enable_thinking": False})
        reach the template.
        """
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        kwargs = checked_template_kwargs(chat_template_kwargs or {}, "chat_template_kwargs")
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt, tools, **kwargs) for c in conversations]
        return self._run(prompts, _per_prompt(params, len(prompts)), use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield text as it is completed (never half a character), then a last chunk with the output."""
        params = params or SamplingParams()
        self._check_constraints([params])
        request_id = self.engine.add_request(self._ids(prompt), params)
        try:
            while not self.engine.requests[request_id].finished:
                for event in self.engine.step():
                    if event.request_id == request_id and (event.new_text or event.new_token_ids):
                        yield StreamChunk(event.new_text, event.new_token_ids, False)
            output = self.engine.release(request_id)
            yield StreamChunk("", [], True, output)
        finally:
            if request_id in self.engine.requests:
                self.engine.abort(request_id)
                self.engine.release(request_id)

    def _check_constraints(self, params: list[SamplingParams]) -> None:
        """A constraint that cannot compile is refused (GrammarError) before any request starts."""
        for sp in params:
            if sp.structured_outputs is not None:
                self.engine.grammars.compile(sp.structured_outputs)

    def _ids(self, prompt: Prompt) -> list[int]:
        return list(prompt) if _is_token_list(prompt) else self.tokenizer.encode(prompt)

    def _run(self, prompts: list[list[int]], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        self._check_constraints(params)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
            started, generated = time.perf_counter(), 0
            done = sum(self.engine.requests[i].finished for i in ids)
            bar.update(done)
            while self.engine.has_unfinished():
                for event in self.engine.step():
                    generated += len(event.new_token_ids)
                    if event.finished:
                        bar.update(1)
                bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - started, 1e-9):.1f}")
        return [self.engine.release(i) for i in ids]


def _is_token_list(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
