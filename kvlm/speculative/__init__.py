"""Speculative decoding: proposers that guess a request's next tokens, checked by one target step."""
