"""kvlm: a small LLM inference engine for the CPU, built around its KV cache."""
import os

# Pin OpenMP threads to cores before torch starts them. Unpinned, on small VMs, every parallel op of a
# batched decode paid for threads migrating between cores: 2-4x slower at 32-64 sequences
# (bench/multi_sequence). A value the user set wins.
os.environ.setdefault("OMP_PROC_BIND", "true")

from kvlm.batch import Batch  # noqa: E402
from kvlm.context import Context, DecodeStatus  # noqa: E402
from kvlm.engine.llm import LLM  # noqa: E402
from kvlm.engine.sampling_params import SamplingParams  # noqa: E402
from kvlm.load import load_model  # noqa: E402

__all__ = ["LLM", "Batch", "Context", "DecodeStatus", "SamplingParams", "load_model"]
