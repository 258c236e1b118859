"""kvlm: a small LLM inference engine for the CPU, built around its KV cache."""
from kvlm.batch import Batch
from kvlm.context import Context, DecodeStatus
from kvlm.load import load_model

__all__ = ["Batch", "Context", "DecodeStatus", "load_model"]
