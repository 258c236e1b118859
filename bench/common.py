"""What every benchmark shares: the model path, a timer, and a markdown table printer."""
from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvlm.fetch import DEFAULT_MODEL, pull

BENCH_DIR = Path(__file__).resolve().parent


def default_gguf() -> Path:
    return pull(DEFAULT_MODEL)


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
