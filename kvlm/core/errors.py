"""Typed errors. Library code raises these; the CLI and server turn them into messages."""


class KvlmError(Exception):
    """Base class of every error kvlm raises on purpose."""


class ModelFetchError(KvlmError):
    """A model could not be found, downloaded or verified."""


class ModelFileError(KvlmError):
    """A model file is unreadable, truncated, or does not match what its metadata promises."""


class CacheError(KvlmError):
    """A KV cache operation was asked to go outside its limits."""


class UnsupportedModelError(ModelFileError):
    """A model file asks for something kvlm does not implement: an architecture, a RoPE type, a tokenizer."""
