"""llama.cpp through llama-cpp-python's low-level C API (llama_batch_init, llama_decode, llama_get_logits_ith), for
the benchmarks that compare kvlm with it: loading (with the AMX-crash workaround), contexts, batch decode, greedy
tokens, and a log callback that keeps llama.cpp's output to errors.

Import this module before kvlm and torch: it reads the CPU mask the process started with, before their OpenMP
pins the main thread to one core (see `llama_threads_free`). It imports neither of them.
"""
from __future__ import annotations

import os

# The CPUs this process may use, read before kvlm and torch start OpenMP, which pins the main thread to one core.
START_AFFINITY = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

N_BATCH = N_UBATCH = 512  # llama.cpp's n_batch and n_ubatch in the benchmarks (kvlm gets the same)


# --- model and context ---------------------------------------------------------------------------------------------

class LlamaCpp:
    """One llama.cpp model, driven through llama-cpp-python's ctypes binding of the C API."""

    def __init__(self, lib, path: Path, threads: int, extra_bufts: bool) -> None:
        self.lib, self.threads = lib, threads
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = extra_bufts
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))

    def context(self, n_ctx: int, n_seq: int, unified: bool = False) -> LlamaContext:
        return LlamaContext(self, n_ctx, n_seq, unified)

    def close(self) -> None:
        self.lib.llama_model_free(self.model)


class LlamaContext:
    """A llama.cpp context with the same decode / greedy interface as the benchmarks' kvlm contexts."""

    def __init__(self, engine: LlamaCpp, n_ctx: int, n_seq: int, unified: bool) -> None:
        lib = self.lib = engine.lib
        self.n_vocab = engine.n_vocab
        params = lib.llama_context_default_params()  # flash_attn_type stays at llama.cpp's default (auto)
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, N_BATCH, N_UBATCH, n_seq
        params.n_threads = params.n_threads_batch = engine.threads
        params.no_perf = True
        if hasattr(params, "kv_unified"):
            params.kv_unified = unified
        elif unified:
            raise RuntimeError("this llama-cpp-python has no kv_unified context parameter")
        self.ctx = lib.llama_init_from_model(engine.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx {n_ctx}, n_seq_max {n_seq})")
        # Split KV (the default): n_ctx is shared out among the n_seq_max sequences (each share rounded up to a
        # multiple of 256). Check every sequence can hold what it needs.
        per_seq = lib.llama_n_ctx_seq(self.ctx) if hasattr(lib, "llama_n_ctx_seq") else lib.llama_n_ctx(self.ctx)
        needed = n_ctx if unified else n_ctx // n_seq
        if per_seq < needed:
            lib.llama_free(self.ctx)
            raise RuntimeError(f"llama.cpp gives each sequence {per_seq} cells, {needed} are needed")
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self.output_rows: list[int] = []

    def decode(self, tokens: list[int], pos: list[int], seq_ids: list[int], outputs: list[bool]) -> None:
        """One llama_decode of at most N_BATCH tokens; `outputs` marks the rows whose logits are wanted."""
        batch = self.batch
        batch.n_tokens = len(tokens)
        for j, (token, p, seq, out) in enumerate(zip(tokens, pos, seq_ids, outputs)):
            batch.token[j] = token
            batch.pos[j] = p
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = seq
            batch.logits[j] = out
        rc = self.lib.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self.output_rows = [j for j, out in enumerate(outputs) if out]

    def greedy(self, k: int) -> int:
        """The argmax token of the k-th output of the last decode."""
        logits = self.lib.llama_get_logits_ith(self.ctx, self.output_rows[k])  # indexed by batch row
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.n_vocab,))))

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


# --- the AMX crash workaround --------------------------------------------------------------------------------------

# llama.cpp's AMX weight buffers (an "extra buffer type") crash in ggml_backend_amx_mul_mat on some AMX CPUs
# (ggml-org/llama.cpp#20824). A crash would kill this process, so a tiny decode is tried in a child process
# first; if it dies, the weights stay in llama.cpp's ordinary CPU buffers (use_extra_bufts = false).
_PROBE = r"""
import sys
import llama_cpp as lib
lib.llama_backend_init()
model = lib.llama_model_load_from_file(sys.argv[1].encode(), lib.llama_model_default_params())
params = lib.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads, params.n_threads_batch = 1024, 512, 512, 2, 2
ctx = lib.llama_init_from_model(model, params)
batch = lib.llama_batch_init(512, 0, 1)
pos = 0
for n in (1, 8, 64, 300):
    batch.n_tokens = n
    for j in range(n):
        batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = 100 + j, pos + j, 1, j == n - 1
        batch.seq_id[j][0] = 0
    assert lib.llama_decode(ctx, batch) == 0
    pos += n
print("ok")
"""


def llama_default_buffers_work(path: Path) -> tuple[bool, str]:
    """Whether a small llama.cpp decode with the default weight buffers succeeds in a child process; and why not."""
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "the probe timed out"
    if probe.returncode == 0 and probe.stdout.strip().endswith("ok"):
        return True, ""
    if probe.returncode < 0:
        return False, f"the probe died of signal {-probe.returncode}"
    return False, f"the probe exited with {probe.returncode}: {probe.stderr.strip().splitlines()[-1:]}"


def add_extra_bufts_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-extra-bufts", default="auto", choices=("auto", "on", "off"),
                        help="llama.cpp extra weight buffers (AMX / repack); auto: on unless a probe crashes")


def resolve_extra_bufts(choice: str, path: Path) -> bool:
    """--llama-extra-bufts as a bool: on, off, or (auto) on unless the probe crashes, saying so."""
    extra_bufts = {"on": True, "off": False}.get(choice)
    if extra_bufts is None:
        extra_bufts, why = llama_default_buffers_work(path)
        if not extra_bufts:
            print(f"NOTE: a llama.cpp decode with its default weight buffers failed ({why}; on AMX CPUs see "
                  "ggml-org/llama.cpp#20824): running llama.cpp with use_extra_bufts = false.", flush=True)
    return extra_bufts


# --- the library: import, logging, threads ---------------------------------------------------------------------------

GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5  # ggml.h's enum ggml_log_level (since ggml 0.9)
_log_state = {"level": 0}
_log_callback = None


def _keep_errors(level: int, text: bytes, user_data) -> None:
    """llama.cpp log callback: errors only. (llama-cpp-python's own callback maps the levels of an older ggml
    enum, so with verbose off it still prints llama.cpp's warnings.)"""
    if level != GGML_LOG_LEVEL_CONT:
        _log_state["level"] = level
    if _log_state["level"] == GGML_LOG_LEVEL_ERROR:
        print(text.decode("utf-8", "replace"), end="", file=sys.stderr, flush=True)


def import_llama_cpp():
    """llama_cpp with the errors-only log callback installed, or None (saying so) if it is not installed."""
    try:
        import llama_cpp
    except ImportError as exc:
        print(f"NOTE: llama_cpp is not importable ({exc}); running kvlm only.\n", flush=True)
        return None
    global _log_callback
    _log_callback = llama_cpp.llama_log_callback(_keep_errors)  # kept alive: llama.cpp holds the pointer
    llama_cpp.llama_log_set(_log_callback, None)
    return llama_cpp


def uses_openmp(lib) -> bool:
    return b"OPENMP = 1" in lib.llama_print_system_info()


@contextmanager
def llama_threads_free(lib):
    """Without OpenMP, llama.cpp's worker threads inherit the main thread's CPU mask, which kvlm's OMP_PROC_BIND
    pinned to one core: widen it for llama.cpp's run. With OpenMP (the usual build) ggml shares torch's libgomp
    team, pinned the same way as kvlm's, and nothing changes."""
    widen = START_AFFINITY is not None and not uses_openmp(lib)
    pinned = os.sched_getaffinity(0) if widen else None
    if widen:
        os.sched_setaffinity(0, START_AFFINITY)
    try:
        yield
    finally:
        if widen:
            os.sched_setaffinity(0, pinned)


@contextmanager
def llama_engine(lib, path: Path, threads: int, extra_bufts: bool) -> Iterator[LlamaCpp]:
    """The model loaded, with llama.cpp's threads free to use every CPU the process started with; freed after."""
    with llama_threads_free(lib):
        engine = LlamaCpp(lib, path, threads, extra_bufts)
        try:
            yield engine
        finally:
            engine.close()


def setup_note(lib, extra_bufts: bool) -> str:
    """How llama.cpp ran, for the benchmarks' summary line."""
    return (f"llama-cpp-python {lib.__version__}, weights as stored in the GGUF, KV f16, flash attention auto, "
            f"use_extra_bufts = {str(extra_bufts).lower()}, "
            + ("OpenMP (the libgomp torch loaded, so pinned like kvlm's)" if uses_openmp(lib) else "no OpenMP"))
