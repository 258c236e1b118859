"""Structured output: constraints on what a request may generate (JSON schema, regex, choice, grammar), as
token masks from llguidance, applied to the raw logits before any other sampling step."""
