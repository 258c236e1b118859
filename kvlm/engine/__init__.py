"""The serving engine: per-request sampling parameters, samplers and stop handling, and the scheduler."""
