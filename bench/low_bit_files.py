"""The low-bit files people download, kvlm's defaults beside llama.cpp on each in the same run: the real
Qwen2.5-Coder-1.5B-Instruct (the known model `qwen2.5-coder-1.5b-instruct`, Q4_K_M) requantized by llama.cpp's own
quantizer to Q2_K, Q3_K_M, IQ4_XS and IQ3_M (cached in $KVLM_HOME/bench), then per file bench/big_model.py's
measurement: start, peak and steady resident memory, 512-token prefill and batch-1 decode, each engine in child
processes of its own, engines interleaved.

    python -m bench.low_bit_files [--types Q2_K,Q3_K_M,IQ4_XS,IQ3_M] [--tokens 32] [--repeats 1]

Requantizing a Q4_K_M file (as llama-quantize --allow-requantize does) loses a little more quality than quantizing
the original weights, which no hub is reachable here to give; the types per tensor, the file sizes and so the speed
and memory are those of the files people download. IQ3_M without an importance matrix is what llama.cpp makes
then (it warns); the types and sizes are the same.
"""
from __future__ import annotations

# First: the llama.cpp driver reads the process's CPU mask before kvlm's and torch's OpenMP pins the main thread.
from bench import llama_cpp_driver as llama  # noqa: F401,I001

import argparse  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import gguf  # noqa: E402

from bench import big_model  # noqa: E402
from bench.big_model_file import quantize  # noqa: E402
from bench.common import machine_line, markdown_table  # noqa: E402
from kvlm.home import kvlm_home  # noqa: E402
from kvlm.loader.fetch import pull  # noqa: E402

SOURCE = "qwen2.5-coder-1.5b-instruct"
FILE_TYPES = {"Q2_K": 10, "Q3_K_M": 12, "IQ4_XS": 30, "IQ3_M": 27}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*


def requantized(name: str) -> Path:
    """The source model in llama.cpp file type `name`, made once."""
    path = kvlm_home() / "bench" / f"{SOURCE}-{name.lower()}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        quantize(pull(SOURCE), partial, FILE_TYPES[name], progress=False)
        partial.rename(path)
    return path


def tensor_types(path: Path) -> str:
    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(FILE_TYPES), help="llama.cpp file types, comma-separated")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded one at a time")
    parser.add_argument("--repeats", type=int, default=1, help="child processes per engine and start (median)")
    args = parser.parse_args()
    rows = []
    for name in args.types.split(","):
        path = requantized(name)
        print(f"\n## {name}: {path.name}, {path.stat().st_size / 2**20:.0f} MiB; {tensor_types(path)}", flush=True)
        median = big_model.compare(big_model.parser().parse_args(
            ["--model", str(path), "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--n-ctx", "4096"]))
        ours, theirs = median[big_model.KVLM, False], median[big_model.LLAMA, False]
        file_gib = path.stat().st_size / 2**30
        rows.append([name, f"{file_gib:.2f}", f"{ours['steady GiB']:.2f} ({ours['steady GiB'] / file_gib:.2f}x file)",
                     f"{theirs['steady GiB']:.2f}",
                     f"{ours['prefill tok/s']:.1f} / {theirs['prefill tok/s']:.1f} = "
                     f"{ours['prefill tok/s'] / theirs['prefill tok/s']:.2f}x",
                     f"{ours['decode tok/s']:.2f} / {theirs['decode tok/s']:.2f} = "
                     f"{ours['decode tok/s'] / theirs['decode tok/s']:.2f}x"])
    print(f"\n{machine_line()}\n")
    print(markdown_table(["file", "GiB", "kvlm steady GiB", "llama.cpp steady GiB", "prefill tok/s kvlm / llama.cpp",
                          "decode tok/s kvlm / llama.cpp"], rows))


if __name__ == "__main__":
    main()
