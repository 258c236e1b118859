"""Single-sequence generation through `Context`: the prompt in one batch, then one token per batch."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvlm.core.batch import Batch
from kvlm.runtime.context import Context, DecodeStatus
from kvlm.core.errors import CacheError, KvlmError
from kvlm.loader.load import Model
from kvlm.sampling.sampler import sample_token


class GenerationError(KvlmError):
    """`Context.decode` did not return OK during generation; the message names the status and its reason."""

    def __init__(self, status: DecodeStatus, last_error: str) -> None:
        super().__init__(f"decode failed with {status.name}: {last_error}")
        self.status = status
        self.last_error = last_error


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
    """Sequence 0 of a Context sized min(n_ctx_train, prompt + max_tokens): the whole prompt in one batch
    (only its last token's logits), then one token per batch. Without the cache (`use_cache=False`, the
    baseline) every step clears the memory and decodes the whole sequence again."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    n_ctx_train = model.config.n_ctx_train
    if len(prompt_ids) >= n_ctx_train:
        raise CacheError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {n_ctx_train}")
    n_ctx = min(n_ctx_train, len(prompt_ids) + settings.max_tokens)
    # One micro-batch of up to n_ctx tokens: the prompt, or a whole recomputed sequence, in one forward.
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_seq_max=1, kv_dtype=kv_dtype)
    generator = torch.Generator().manual_seed(settings.seed) if settings.seed is not None else None
    result = Generation(list(prompt_ids))
    if settings.max_tokens == 0:
        return result
    started = time.perf_counter()
    logits = _decode(ctx, prompt_ids)
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
        if len(result.token_ids) >= settings.max_tokens or ctx.memory.seq_pos_max(0) + 1 >= n_ctx:
            break
        if settings.use_cache:
            logits = _decode(ctx, [token])
        else:
            ctx.memory.clear()
            logits = _decode(ctx, prompt_ids + result.token_ids)
    result.decode_seconds = time.perf_counter() - started
    return result


def _decode(ctx: Context, tokens: list[int]) -> torch.Tensor:
    """Append `tokens` to sequence 0 (positions continue its memory); the logits of the last one."""
    status = ctx.decode(Batch.for_sequence(tokens))
    if status != DecodeStatus.OK:
        raise GenerationError(status, ctx.last_error)
    return ctx.get_logits_ith(-1)
