"""kvlm: a small LLM inference engine for the CPU, built around its KV cache."""
from kvlm import startup  # noqa: F401  - first: it pins OpenMP threads before torch starts them

from kvlm.core.batch import Batch  # noqa: E402
from kvlm.runtime.context import Context, DecodeStatus  # noqa: E402
from kvlm.engine.llm import LLM  # noqa: E402
from kvlm.sampling.params import SamplingParams  # noqa: E402
from kvlm.loader.load import load_model  # noqa: E402
from kvlm.structured.params import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "Batch", "Context", "DecodeStatus", "SamplingParams", "StructuredOutputsParams", "load_model"]
