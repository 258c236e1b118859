"""Choosing tokens from logits: `SamplingParams` (vLLM's) and the samplers (one request's, and one draw for the
single-sequence loop)."""
