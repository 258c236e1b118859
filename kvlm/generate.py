"""Single-sequence generation over the two paths: prefill the prompt once, then decode token by token."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvlm.errors import CacheError
from kvlm.load import Model
from kvlm.memory.sequence_cache import SequenceCache
from kvlm.model.decoder import Decoder
from kvlm.sampling import sample_token


def prefill(decoder: Decoder, cache: SequenceCache, token_ids: list[int]) -> torch.Tensor:
    """Run the whole prompt in one pass (positions from row index); logits of its last token."""
    n_tokens = len(token_ids)
    view = cache.prefill_view(n_tokens)
    positions = torch.arange(cache.length, cache.length + n_tokens)
    logits = decoder.forward(torch.tensor(token_ids), positions, view, output_rows=torch.tensor([n_tokens - 1]))
    cache.commit(n_tokens)
    return logits[0]


def decode(decoder: Decoder, cache: SequenceCache, token_id: int) -> torch.Tensor:
    """One new token at position kv_pos = cache.length, read by RoPE and the cache at run time."""
    kv_pos = torch.tensor([cache.length])
    logits = decoder.forward(torch.tensor([token_id]), kv_pos, cache.decode_view(kv_pos))
    cache.commit(1)
    return logits[0]


def recompute(decoder: Decoder, cache: SequenceCache, token_ids: list[int]) -> torch.Tensor:
    """The no-cache baseline: forget everything and run the whole sequence again."""
    cache.reset()
    return prefill(decoder, cache, token_ids)


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def timings(self) -> dict[str, float]:
        decoded = max(len(self.token_ids) - 1, 0)  # the first token comes out of the prefill
        return {
            "prefill_tokens_per_s": _rate(len(self.prompt_token_ids), self.prefill_seconds),
            "decode_tokens_per_s": _rate(decoded, self.decode_seconds),
        }


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def generate(
    model: Model,
    prompt_ids: list[int],
    settings: GenerationSettings,
    on_token: Callable[[int], None] | None = None,
    kv_dtype: str = "f32",
) -> Generation:
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    n_ctx = model.config.n_ctx_train
    if len(prompt_ids) >= n_ctx:
        raise CacheError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {n_ctx}")
    cache = SequenceCache(model.config, min(n_ctx, len(prompt_ids) + settings.max_tokens), kv_dtype)
    generator = torch.Generator().manual_seed(settings.seed) if settings.seed is not None else None
    result = Generation(list(prompt_ids))
    if settings.max_tokens == 0:
        return result
    started = time.perf_counter()
    logits = prefill(model.decoder, cache, prompt_ids)
    result.prefill_seconds = time.perf_counter() - started
    started = time.perf_counter()
    while True:
        token = sample_token(logits, settings.temperature, generator)
        result.token_ids.append(token)
        if on_token is not None:
            on_token(token)
        if token in model.tokenizer.stop_ids and not settings.ignore_eos:
            result.finish_reason = "stop"
            break
        if len(result.token_ids) >= settings.max_tokens or cache.length >= cache.max_context:
            break
        if settings.use_cache:
            logits = decode(model.decoder, cache, token)
        else:
            logits = recompute(model.decoder, cache, prompt_ids + result.token_ids)
    result.decode_seconds = time.perf_counter() - started
    return result
