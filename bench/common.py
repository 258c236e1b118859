"""What every benchmark shares: the model path, a timer, and a markdown table printer."""
from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvlm.loader.fetch import DEFAULT_MODEL, resolve_model

BENCH_DIR = Path(__file__).resolve().parent


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a known model name or a .gguf file (default: {DEFAULT_MODEL}, the one RESULTS.md uses)")


def model_gguf(spec: str) -> Path:
    """--model as a GGUF path: a known name is pulled into kvlm's cache on first use."""
    return resolve_model(spec)


def model_label(path: Path) -> str:
    """A short name for titles: the file name without .gguf."""
    return path.name.removesuffix(".gguf")


def can_plot() -> bool:
    """Whether matplotlib is installed (an optional extra); the tables are printed either way."""
    if importlib.util.find_spec("matplotlib") is None:
        print("\nno plot: matplotlib is not installed")
        return False
    return True


def plot_path(stem: str, spec: str) -> Path:
    """bench/<stem>.png for the default model (the plots RESULTS.md shows); bench/<stem>-<model>.png otherwise."""
    suffix = "" if spec == DEFAULT_MODEL else "-" + Path(spec).name.removesuffix(".gguf")
    return BENCH_DIR / f"{stem}{suffix}.png"


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def machine_line() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
