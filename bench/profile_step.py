"""Where one engine step spends its time, at batch 1, 8, 32 and 64, on kvlm's defaults.

    python -m bench.profile_step [--model NAME] [--batches 1 8 32 64] [--steps 32] [--prompt-tokens 64] [--ops]

Each batch size runs B requests (distinct `--prompt-tokens`-token prompts, EOS ignored) to the end of their prompts, then times
`--steps` decode steps, each split into:

- weight products: every Linear call (native quantized kernels, packed or dense products), and the products
  inside the fused decode layers (timed by their C++ between its phases: kvlm.kernels.decode_layer.layer_times);
- attention: the K/V write and attention of every layer (`attend_layer`, as the blocks call it), and the fused
  layers' attention;
- other model ops: the rest of the forward pass (norms, RoPE, activations, residual adds, embedding, head's norm,
  the eager dispatch of each, and the calls into the fused layers);
- memory bookkeeping: `Context.decode` outside the forward pass (batch checks, cell search, views, masks);
- scheduling: choosing the step's work and building its batch;
- sampling: choosing each request's token from its logits;
- stop/detokenize: stop checks and the incremental text;
- Python/dispatch: the engine's own glue, everything in `Engine.step` not above;
- serving (for `kvlm serve`): what the server's engine thread adds around the step (metrics, handing events to
  the asyncio handlers).

Three ways in: `LLM.generate` (the engine, as `kvlm generate` and `chat` run it: they stream one request through
the same `Engine.step`), and `kvlm serve`'s engine thread with its metrics observer (`AsyncEngine`), requests sent
from asyncio in the same process. Timers wrap whole calls (about a microsecond each, a few hundred per step).
`--ops` also prints torch's profiler's top operators for batch 1.
"""
from __future__ import annotations

import kvlm  # noqa: F401  - before torch: it sets OpenMP's and OpenBLAS's threads before they start

import argparse
import asyncio
import functools
import platform
import time
from collections import defaultdict

import torch

from bench.common import add_model_option, markdown_table, model_gguf
from kvlm.runtime.context import Context
from kvlm.engine.engine import Engine
from kvlm.engine.llm import LLM
from kvlm.sampling.sampler import RequestSampler
from kvlm.sampling.params import SamplingParams
from kvlm.engine.scheduler import Scheduler
from kvlm.engine.stop import StopChecker
from kvlm.kernels import native_kernels
from kvlm.kernels.decode_layer import layer_times
from kvlm.model import blocks, linear
from kvlm.model import decoder as decoder_module
from kvlm.model.decoder import Decoder
from kvlm.server.async_engine import AsyncEngine
from kvlm.server.metrics import ServerMetrics
from kvlm.startup import in_passing_thread

PROMPT_TOKENS = 64  # the default prompt length
CATEGORIES = ("weight products", "attention", "other model ops", "memory bookkeeping", "scheduling", "sampling",
              "stop/detokenize", "Python/dispatch", "serving")


class StepClock:
    """Seconds spent inside wrapped calls, by name; nested calls of the same name count once. The fused decode
    layers' own phase times (native) are read at reset and split."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth: dict[str, int] = defaultdict(int)
        self._on = False
        self._kernels = native_kernels()
        self._native_start: dict[str, float] = {}

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        self._on = value
        if self._kernels is not None:
            layer_times(self._kernels, value)

    def _native(self) -> dict[str, float]:
        if self._kernels is None:
            return {"products": 0.0, "attention": 0.0, "other": 0.0}
        return layer_times(self._kernels, self._on)

    def wrap(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not self.on or self._depth[name]:
                return original(*args, **kwargs)
            self._depth[name] += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self._depth[name] -= 1

        setattr(owner, attribute, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self._native_start = self._native()

    def split(self) -> dict[str, float]:
        """The step's time by CATEGORIES (each wrapped total minus what is inside it)."""
        s = self.seconds
        fused = {name: value - self._native_start[name] for name, value in self._native().items()}
        products, attention = s["products"] + fused["products"], s["attention"] + fused["attention"]
        model = s["forward"]
        engine = s["engine step"]
        parts = {
            "weight products": products,
            "attention": attention,
            "other model ops": model - products - attention,
            "memory bookkeeping": s["decode"] - model,
            "scheduling": s["schedule"] + s["batch"],
            "sampling": s["sample"],
            "stop/detokenize": s["stop"],
        }
        parts["Python/dispatch"] = engine - s["decode"] - parts["scheduling"] - s["sample"] - s["stop"]
        parts["serving"] = s["serve step"] - engine if s["serve step"] else 0.0
        return parts


def instrument() -> StepClock:
    clock = StepClock()
    for cls in (linear.DenseLinear, linear.PackedLinear, linear.QuantizedLinear, linear.NativeDenseLinear):
        clock.wrap(cls, "__call__", "products")
    clock.wrap(decoder_module, "float32_product", "products")  # the output head
    clock.wrap(blocks, "attend_layer", "attention")
    clock.wrap(Decoder, "forward", "forward")
    clock.wrap(Context, "decode", "decode")
    clock.wrap(Scheduler, "schedule", "schedule")
    clock.wrap(Engine, "_batch", "batch")
    clock.wrap(Engine, "step", "engine step")
    clock.wrap(RequestSampler, "sample", "sample")
    clock.wrap(StopChecker, "add", "stop")
    clock.wrap(AsyncEngine, "_step", "serve step")
    return clock


def prompts(batch: int, vocab: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """Distinct prompts (no shared prefix to reuse): token ids spread over the vocabulary's common range."""
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(100, min(vocab, 20000), (length,), generator=g).tolist() for _ in range(batch)]


def prefill_steps(llm: LLM, batch: int, length: int) -> int:
    """Steps the prompts take, in each of which the requests already past theirs take a token."""
    return -(-batch * length // llm.engine.scheduler.max_num_batched_tokens)


def run_engine(llm: LLM, clock: StepClock, batch: int, steps: int, length: int) -> tuple[float, int]:
    """Decode `steps` steps of `batch` requests through Engine.step; returns (wall seconds, steps timed)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2 + prefill_steps(llm, batch, length), ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(batch, llm.model.config.vocab_size, length)]
    while any(len(engine.requests[i].output_token_ids) == 0 for i in ids):
        engine.step()  # the prompts (several steps when they exceed max_num_batched_tokens)
    clock.reset()
    clock.on = True
    started, timed = time.perf_counter(), 0
    while timed < steps and all(not engine.requests[i].finished for i in ids):
        engine.step()
        timed += 1
    wall = time.perf_counter() - started
    clock.on = False
    if timed == 0:
        raise RuntimeError(f"no decode step ran at batch {batch}: a request ended before its prompt did")
    while engine.has_unfinished():
        engine.step()
    for i in ids:
        engine.release(i)
    return wall, timed


def run_served(llm: LLM, clock: StepClock, batch: int, steps: int, length: int) -> tuple[float, int]:
    """The same through the server's engine thread: `batch` streaming clients in asyncio. The clock and the wall
    time start once every client has its first token (every prompt done) and stop when each has `steps` more."""
    runner = AsyncEngine(llm.engine, ServerMetrics())
    runner.start()
    counts = [0] * batch
    at_start: list[int] = []  # each client's tokens when the window opened
    window: dict[str, float] = {}

    async def client(index: int, prompt: list[int]) -> None:
        params = SamplingParams(max_tokens=steps + 2 + prefill_steps(llm, batch, length), ignore_eos=True)
        async for _ in runner.generate(f"p{index}", prompt, params):
            counts[index] += 1
            if "start" not in window and min(counts) >= 1:
                clock.reset()
                clock.on = True
                window["start"] = time.perf_counter()
                at_start.extend(counts)
            if "start" in window and "end" not in window and all(c >= s + steps for c, s in zip(counts, at_start)):
                clock.on = False
                window["end"] = time.perf_counter()

    async def main() -> None:
        await asyncio.gather(*(client(i, p) for i, p in enumerate(prompts(batch, llm.model.config.vocab_size,
                                                                            length))))

    asyncio.run(main())
    runner.stop()
    return window["end"] - window["start"], steps


def profile(llm: LLM, clock: StepClock, batch: int, steps: int, length: int, served: bool) -> dict[str, float]:
    """Milliseconds per step by category, and the whole step."""
    wall, timed = (run_served if served else run_engine)(llm, clock, batch, steps, length)
    per_step = {name: 1e3 * value / timed for name, value in clock.split().items()}
    # What the timers do not cover: the loop around the step (and, served, the engine thread's waits).
    per_step["Python/dispatch"] += 1e3 * wall / timed - sum(per_step.values())
    per_step["step"] = sum(per_step[c] for c in CATEGORIES)
    per_step["tokens/s"] = batch * 1e3 / per_step["step"]
    return per_step


def print_ops(llm: LLM, steps: int) -> None:
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
           for p in prompts(1, llm.model.config.vocab_size)]
    engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    for i in ids:
        engine.release(i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each request's prompt length")
    parser.add_argument("--ops", action="store_true", help="also print torch's profiler's top ops at batch 1")
    args = parser.parse_args()
    path = model_gguf(args.model)
    clock = instrument()
    # Room for every sequence's prompt and output at the largest batch: none is cut short by a full cache.
    n_ctx = max(args.batches) * (2 * args.prompt_tokens + args.steps + 8)  # the prompts' steps' tokens too
    # As `kvlm serve` does: loaded on a thread that ends, and each way's steps on a thread of their own, so no
    # thread keeps OpenMP workers beside the one stepping (kvlm.startup.in_passing_thread says why).
    llm = in_passing_thread(lambda: LLM(str(path), max_num_seqs=max(args.batches), n_ctx=n_ctx))
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {path.name}; "
          f"{llm.model.decoder.describe()}")
    print(f"{args.prompt_tokens}-token prompts, {args.steps} decode steps timed per batch size; ms per step")
    for way, served in (("LLM.generate / kvlm generate (Engine.step)", False), ("kvlm serve (engine thread)", True)):
        rows = []
        for batch in args.batches:
            result = in_passing_thread(lambda: profile(llm, clock, batch, args.steps, args.prompt_tokens, served))
            rows.append([batch] + [f"{result[c]:.2f}" for c in CATEGORIES] + [f"{result['step']:.2f}",
                                                                              f"{result['tokens/s']:.1f}"])
        print(f"\n### {way}\n")
        print(markdown_table(["batch", *CATEGORIES, "step", "tokens/s"], rows))
    if args.ops:
        in_passing_thread(lambda: print_ops(llm, args.steps))


if __name__ == "__main__":
    main()
