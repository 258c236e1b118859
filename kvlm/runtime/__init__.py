"""Running a loaded model over its memory: `Context.decode` (the micro-batch loop every caller goes through), the
single-sequence `generate` loop, and perplexity."""
