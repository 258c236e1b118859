"""The serving engine: requests, the scheduler, prefix reuse, stop handling and the step loop (its samplers are in
kvlm.sampling)."""
