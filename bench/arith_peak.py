"""The machine's arithmetic peaks: the ceiling under prefill, as bench.memory_bandwidth is the floor under decode.

    python -m bench.arith_peak [--threads N] [--seconds 1]

A prompt's products multiply every weight of every matrix by every prompt token: compute-bound, where batch-1 decode
is bound by reading the weights. kvlm's native kernels (and llama.cpp's, on AVX2) multiply 8-bit weight levels by
8-bit activations with vpmaddubsw then vpmaddwd; bench/arith_peak.cpp runs that mix (and float32 FMAs, and AVX-512
VNNI's vpdpbusd where the CPU has it) in independent chains from registers, so nothing but the arithmetic units is
timed, and prints multiply-adds per second. bench.big_model prints prefill beside the int8 peak as a share of it:
prompt tokens/s times the multiply-adds of a token's products (`token_costs`).

The program is compiled once per CPU kind (-march=native, as the kernels) into $KVLM_HOME/bench.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
from pathlib import Path

from kvlm.home import kvlm_home
from kvlm.kernels.native import compiler, cpu_flags
from kvlm.startup import START_CPUS

SOURCE = Path(__file__).with_name("arith_peak.cpp")
INT8 = "int8_avx2"  # the mix the products use on every x86-64 CPU kvlm builds tiles for
VNNI512 = "int8_vnni512"  # theirs where the kernels sum with AVX-512 VNNI in 512-bit registers


def products_peak(measured: dict[str, float]) -> tuple[str, float]:
    """The int8 peak the native products can reach here: vpdpbusd on 512-bit registers where the kernels were built
    with it (kvlm.kernels' isa names "avx512-vnni"), else the vpmaddubsw + vpmaddwd mix. (name, multiply-adds/s)."""
    from kvlm.kernels import native_kernels

    kernels = native_kernels()
    name = VNNI512 if kernels is not None and "avx512-vnni" in kernels.isa and VNNI512 in measured else INT8
    return name, measured.get(name, float("nan"))


def program() -> Path:
    """The compiled microbenchmark, built if needed."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++ on the PATH, or $CXX)")
    key = hashlib.sha256(SOURCE.read_bytes() + cpu_flags().encode() + cxx.encode()).hexdigest()[:16]
    target = kvlm_home() / "bench" / f"arith_peak-{key}"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        done = subprocess.run([cxx, "-O2", "-march=native", "-fopenmp", "-o", str(partial), str(SOURCE)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    return target


def peaks(threads: int, seconds: float = 1.0) -> dict[str, float]:
    """Multiply-adds per second of each mix this CPU runs ("int8_avx2", "fp32_avx2", ...), on `threads` threads."""
    # The caller's OpenMP (torch's, pinned by kvlm) has bound this thread to one CPU, and a child inherits the mask:
    # where the CPUs are separate cores (not one core's two hyperthreads) it would time one core's peak.
    done = subprocess.run([str(program()), str(threads), str(seconds)], check=True, capture_output=True, text=True,
                          env={**os.environ, "OMP_PROC_BIND": "false"},
                          preexec_fn=lambda: os.sched_setaffinity(0, START_CPUS))
    return {name: float(value) for name, value in (line.split() for line in done.stdout.splitlines())}


def token_costs(path: str | Path) -> tuple[int, int]:
    """(multiply-adds, bytes of weights read) of one token's products in a GGUF model: every matrix, an expert
    tensor in proportion to the experts a token is routed to. The multiply-adds are a prompt token's: the embedding
    (a lookup) and the LM head (computed for the last prompt token only) aside, as is attention over the cache (under
    1% of a 512-token prompt's); the bytes a decoded token's, the LM head and every other tensor included, the
    embedding's one row aside (unless it is the head too)."""
    from kvlm.loader.gguf_file import read_gguf_config
    from kvlm.loader.gguf_reader import GGUFFile

    config = read_gguf_config(path)
    gguf = GGUFFile(Path(path))
    try:
        tied = "output.weight" not in gguf.tensors
        multiply_adds = read = 0
        for name, info in gguf.tensors.items():
            share = (config.n_expert_used, config.n_expert) if len(info.shape) == 3 else (1, 1)
            if name in ("token_embd.weight", "per_layer_token_embd.weight"):
                read += info.nbytes if tied and name == "token_embd.weight" else 0
                continue
            read += info.nbytes * share[0] // share[1]
            if len(info.shape) >= 2 and name != "output.weight":
                multiply_adds += info.n_elements * share[0] // share[1]
        return multiply_adds, read
    finally:
        gguf.close()


def main() -> None:
    import torch

    from bench.common import machine_line

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    print(machine_line())
    for threads in sorted({1, args.threads}):
        print(f"{threads} thread(s): " + ", ".join(f"{name} {value / 1e9:.1f} G multiply-adds/s"
                                                  for name, value in peaks(threads, args.seconds).items()))


if __name__ == "__main__":
    main()
