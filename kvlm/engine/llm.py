"""`LLM`: what most users call. Many prompts in, answers out, continuous batching underneath."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from kvlm.engine.pooling import checked_dimensions, checked_pooling, truncated
from kvlm.engine.engine import DEFAULT_DISK_TIER, Engine, memory_request
from kvlm.engine.request import RequestOutput
from kvlm.sampling.params import SamplingParams
from kvlm.loader.fetch import DEFAULT_MODEL
from kvlm.loader.load import Model, load_model
from kvlm.loader.memory_plan import parse_size
from kvlm.memory.kv_store import AUTO
from kvlm.speculative.config import SpeculativeConfig
from kvlm.structured.compiler import GrammarError
from kvlm.structured.params import StructuredOutputsParams
from kvlm.text.tokenizer import checked_template_kwargs
from kvlm.tool_calls.chat_output import ChatOutputSpec
from kvlm.tool_calls.reasoning import reasoning_for_template
from kvlm.tool_calls.tool_choice import plan_tools

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
                 memory_budget: int | None = None,
                 speculative_config: SpeculativeConfig | dict | str | None = None, device: str = AUTO,
                 enforce_eager: bool = False, prefix_cache_ram: int | str = 0, prefix_cache_dir: str | None = None,
                 prefix_cache_disk: int | str = DEFAULT_DISK_TIER, scheduling_policy: str = "fcfs") -> None:
        """`swa_full`: for models with sliding-window layers, keep every cell of those layers (more memory; a
        cached prefix is then always reusable) instead of only each sequence's window. `tensor_parallel_size` N:
        the model's heads and MLP split over N processes (this one and N - 1 it starts; see kvlm.parallel).

        `n_ctx` None is the largest context that fits in memory, up to the model's own. `memory_budget` (bytes)
        caps weights, the KV cache and buffers. What does not fit is refused before it is loaded or allocated
        (MemoryPlanError, each part named).

        `device`: "cpu", "cuda" (an NVIDIA GPU) or "auto" (CUDA where torch sees one), as vLLM's; on a GPU decode
        steps replay CUDA graphs unless `enforce_eager` (vLLM's).

        `speculative_config`: vLLM's, e.g. {"method": "ngram", "num_speculative_tokens": 4} (prompt lookup) or
        {"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4} (a draft model); the output is the
        same as without it (see kvlm.speculative).

        `prefix_cache_ram`, `prefix_cache_dir`, `prefix_cache_disk`: finished sequences' states kept in RAM (bytes,
        or a size such as "2GiB"; 0: none) and in a directory (up to `prefix_cache_disk`; it outlives the process),
        loaded by later prompts that start with them (kvlm.engine.prefix_tiers), as llama.cpp's --cache-ram.

        `scheduling_policy` "priority" (vLLM's): generate's `priority` orders the requests, lower first."""
        speculative_config = SpeculativeConfig.parse(speculative_config)
        request = memory_request(n_ctx, max_num_seqs, max_num_batched_tokens, kv_dtype, enable_prefix_caching,
                                 swa_full=swa_full,
                                 speculative_tokens=speculative_config.num_speculative_tokens if speculative_config else 0)
        if not isinstance(model, Model):
            model = load_model(model, dtype, quant=quant, batch_invariant=batch_invariant, compile=compile,
                               tensor_parallel_size=tensor_parallel_size, memory=request, memory_budget=memory_budget,
                               device=device)
            n_ctx = model.plan.n_ctx  # as planned before loading
        elif tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size applies when LLM loads the model; for a loaded model, pass it "
                             "to load_model")
        self.model = model
        self.tokenizer = self.model.tokenizer
        self.engine = Engine(self.model, n_ctx=n_ctx, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, kv_dtype=kv_dtype,
                             enable_prefix_caching=enable_prefix_caching, swa_full=swa_full,
                             memory_budget=memory_budget, speculative_config=speculative_config,
                             enforce_eager=enforce_eager, prefix_cache_ram=_bytes(prefix_cache_ram),
                             prefix_cache_dir=prefix_cache_dir, prefix_cache_disk=_bytes(prefix_cache_disk),
                             scheduling_policy=scheduling_policy)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is text (tokenized as is) or a list of token ids. `priority`:
        one per prompt, under the priority scheduling policy (vLLM's)."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} values for {len(prompts)} prompts")
        return self._run([self._ids(p) for p in prompts], _per_prompt(params, len(prompts)), use_tqdm,
                         priority=priority)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None, dimensions: int | None = None,
              use_tqdm: bool = True) -> list[RequestOutput]:
        """One embedding per prompt, in order (`output.embedding`: L2-normalized floats), batched through the engine
        as generation is. `pooling`: "last", "mean" or "cls" (kvlm.engine.pooling); the model's own by default
        (its GGUF's pooling_type, a sentence-transformers folder's pooling; "last" where neither says).
        `dimensions`: the first that many values, normalized again (Matryoshka models)."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        pooling = checked_pooling(pooling or self.model.config.pooling)
        checked_dimensions(dimensions, self.model.config.n_embd)
        ids = [self._ids(p) for p in prompts]
        outputs = self._run(ids, [SamplingParams(max_tokens=1)] * len(ids), use_tqdm, pooling=pooling)
        for output in outputs:
            if output.embedding is not None:
                output.embedding = truncated(output.embedding, dimensions)
        return outputs

    def chat(self, conversations: Conversation | Sequence[Conversation],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Each conversation (a list of {"role", "content"}) is rendered with the model's chat template.

        As in vLLM, `tools` (OpenAI function specs) and `chat_template_kwargs` (e.g. {"enable_thinking": False})
        reach the template. With `tools` (tool_choice "auto" by default, "none", "required", or a function's name
        or {"type": "function", "function": {"name": ...}}) or a template that reasons (<think> blocks, harmony
        channels), each output also carries `message`: content, tool_calls and reasoning_content as OpenAI's
        API returns them. A harmony output's text keeps its special tokens (<|channel|>...), which are read.
        """
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        kwargs = checked_template_kwargs(chat_template_kwargs or {}, "chat_template_kwargs")
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, tools, **kwargs) for c in conversations]
        plan = plan_tools(self.tokenizer.chat_template, tools or [], _tool_choice_name(tools, tool_choice),
                          parallel_tool_calls, self.engine.grammars.special_tokens)
        specs = [ChatOutputSpec(reasoning_for_template(self.tokenizer.chat_template, text), plan.format,
                                tuple(tools or ()), named_tool=plan.named, parallel=parallel_tool_calls)
                 for text in texts]
        params = _per_prompt(params, len(texts))
        if plan.lazy_grammar is not None and (any(p.structured_outputs is not None for p in params)
                                              or not self._compiles(plan.lazy_grammar)):
            plan = dataclasses.replace(plan, lazy_grammar=None)  # the request's own constraint, or calls as written
        if plan.grammar is not None:  # a call forced, or kept right once the model opens one (tool_choice auto)
            params = [_forcing(p, plan.grammar) for p in params]
        # the readers' markers are special tokens (harmony): the output text keeps them, so output.text shows them
        params = [dataclasses.replace(p, skip_special_tokens=False) if spec.keeps_special_tokens else p
                  for p, spec in zip(params, specs)]
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self._run(prompts, params, use_tqdm, [plan.constraint_start(s.reasoning) for s in specs])
        for output, spec in zip(outputs, specs):
            if spec.reasoning is not None or spec.tool_format is not None:
                output.message, output.finish_reason = spec.message(output.text, output.finish_reason)
        return outputs

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

    def _compiles(self, grammar: str) -> bool:
        """Whether the tools' lazy grammar compiles (where it does not, calls are read as written)."""
        try:
            self.engine.grammars.compile(StructuredOutputsParams(grammar=grammar))
        except GrammarError:
            return False
        return True

    def _check_constraints(self, params: list[SamplingParams]) -> None:
        """A constraint that cannot compile is refused (GrammarError) before any request starts."""
        for sp in params:
            if sp.structured_outputs is not None:
                self.engine.grammars.compile(sp.structured_outputs)

    def _ids(self, prompt: Prompt) -> list[int]:
        return list(prompt) if _is_token_list(prompt) else self.tokenizer.encode(prompt)

    def _run(self, prompts: list[list[int]], params: list[SamplingParams], use_tqdm: bool,
             reasoning_ended: list | None = None, pooling: str | None = None,
             priority: Sequence[int] | None = None) -> list[RequestOutput]:
        self._check_constraints(params)
        for rank in priority or ():
            self.engine.check_priority(rank)
        reasoning_ended = reasoning_ended or [None] * len(prompts)
        priority = priority or [0] * len(prompts)
        ids = [self.engine.add_request(p, sp, reasoning_ended=r, pooling=pooling, priority=rank)
               for p, sp, r, rank in zip(prompts, params, reasoning_ended, priority)]
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


def _tool_choice_name(tools: list[dict] | None, tool_choice: str | dict | None) -> str:
    """"none", "auto", "required" or a function's name, from any of OpenAI's spellings."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice.get("function", {}).get("name")
    names = [tool["function"]["name"] for tool in tools or []]
    if tool_choice not in ("none", "auto", "required") and tool_choice not in names:
        raise ValueError(f"tool_choice {tool_choice!r} is neither none, auto, required nor one of the tools {names}")
    return tool_choice


def _forcing(params: SamplingParams, grammar: str) -> SamplingParams:
    if params.structured_outputs is not None:
        raise ValueError("a structured_outputs constraint cannot be combined with a forced tool call")
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _bytes(size: int | str) -> int:
    return parse_size(size) if isinstance(size, str) else size
