"""Rotary position embeddings: the frequencies a model's config asks for, and the rotations they give.

The frequencies are those of transformers' `ROPE_INIT_FUNCTIONS` (modeling_rope_utils.py), computed with the
same float32 operations so cos/sin match its rotary embedding; `rope_from_hf_config` and `rope_from_gguf`
read a config.json or a GGUF file's metadata into the same `RopeScaling`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvlm.core.errors import UnsupportedModelError

KINDS = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
GGUF_KINDS = ("none", "linear", "yarn")
_NEEDS_ORIGINAL = ("llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How a model's RoPE frequencies are made; `kind` names transformers' rope_type.

    `original_max_position_embeddings` is the context the unscaled frequencies were trained for (llama3,
    yarn, longrope; for dynamic, transformers' `max_position_embeddings`). `freq_factors` are per-frequency divisors
    (a GGUF's `rope_freqs.weight`), applied after the kind's own scaling as llama.cpp does.

    LongRoPE (Phi-3, Phi-4-mini) divides each frequency by one of two sets of factors: `short_factor` for sequences
    within the original context, `long_factor` beyond it; `long_context` says which set this scaling uses (see
    `for_context`), and `attention_factor` (derived from `factor` when None) scales cos and sin.
    """

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: derived from factor (and mscale / mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range outwards to whole dimensions
    freq_factors: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    long_context: bool = False  # longrope: the long factors (a context longer than the original one)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UnsupportedModelError(f"RoPE type {self.kind!r} is not supported (supported: {', '.join(KINDS)})")
        if not _is_number(self.theta) or self.theta <= 1:
            raise ValueError(f"RopeScaling.theta must be a number > 1, got {self.theta!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            _check_positive(name, getattr(self, name))
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None and not _is_number(getattr(self, name)):
                raise ValueError(f"RopeScaling.{name} must be a number or None, got {getattr(self, name)!r}")
        if self.attention_factor is not None:
            _check_positive("attention_factor", self.attention_factor)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"RopeScaling.truncate must be True or False, got {self.truncate!r}")
        self._check_original()
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must be greater than "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        if self.freq_factors is not None:
            object.__setattr__(self, "freq_factors", _positive_numbers("freq_factors", self.freq_factors))
        if self.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                object.__setattr__(self, name, _positive_numbers(name, getattr(self, name)))
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError(f"RopeScaling: longrope needs as many long factors as short ones, got "
                                 f"{len(self.long_factor)} and {len(self.short_factor)}")

    def for_context(self, n_ctx: int | None) -> RopeScaling:
        """The scaling a context of n_ctx positions rotates with: LongRoPE's long factors when it is longer than the
        original context (llama.cpp's rule; transformers, which recomputes a sequence's whole cache when it grows
        past that length, gives the same rotations for sequences within the original length in a context within it,
        and for sequences past it in a context past it); every other kind as it is."""
        if self.kind != "longrope":
            return self
        long = n_ctx is not None and n_ctx > self.original_max_position_embeddings
        return self if long == self.long_context else dataclasses.replace(self, long_context=long)

    def _check_original(self) -> None:
        original = self.original_max_position_embeddings
        if original is None and self.kind not in _NEEDS_ORIGINAL:
            return
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError(
                f"RopeScaling.original_max_position_embeddings must be a positive integer for RoPE type "
                f"{self.kind!r}, got {original!r}"
            )


class Rope:
    """cos/sin for positions read at run time; `shift_cos_sin` rotates cached K by a position change."""

    def __init__(self, scaling: RopeScaling, head_dim: int) -> None:
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RoPE head_dim must be a positive even integer, got {head_dim!r}")
        for name in ("freq_factors", "short_factor"):
            factors = getattr(scaling, name)
            if factors and len(factors) != head_dim // 2:
                raise ValueError(f"RoPE {name} has {len(factors)} values, expected head_dim / 2 = {head_dim // 2}")
        self.scaling = scaling
        self.head_dim = head_dim
        self.inv_freq = _with_freq_factors(_INV_FREQ[scaling.kind](scaling, head_dim), scaling)
        self.attention_factor = _attention_factor(scaling)

    def inv_freq_at(self, seq_len: int) -> torch.Tensor:
        """The frequencies of a forward whose highest position is seq_len - 1 (only dynamic depends on it)."""
        s = self.scaling
        if s.kind == "dynamic" and seq_len > s.original_max_position_embeddings:
            return _with_freq_factors(_dynamic_inv_freq(s, self.head_dim, seq_len), s)
        return self.inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n_tokens, 1, head_dim] of the rotation at `positions`, attention factor included.

        Dynamic NTK recomputes its frequencies from this call's highest position, as transformers does on
        every forward; the K rows already cached keep the rotation they were written with.
        """
        inv_freq = self.inv_freq
        if self.scaling.kind == "dynamic" and positions.numel():
            inv_freq = self.inv_freq_at(int(positions.max()) + 1)
        cos, sin = _cos_sin(positions, inv_freq)
        return (cos * self.attention_factor).to(dtype), (sin * self.attention_factor).to(dtype)

    def shift_cos_sin(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pure rotation by `deltas` (no attention factor: cached K already carries it once).

        Uses the base frequencies; for dynamic NTK past the original length that is an approximation.
        """
        return _cos_sin(deltas, self.inv_freq)


class NoRope:
    """The rotation of a layer without RoPE (SmolLM3's every fourth): cos 1 and sin 0, which leave Q and K exactly as
    they are, so that such a layer runs the same ops (and the same native decode call) as the others."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (positions.shape[0], 1, self.head_dim)
        return torch.ones(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    def shift_cos_sin(self, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_sin(deltas, torch.float32)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


# --- the frequencies, operation for operation as transformers computes them ---

def _default_inv_freq(s: RopeScaling, dim: int) -> torch.Tensor:
    return 1.0 / (s.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear_inv_freq(s: RopeScaling, dim: int) -> torch.Tensor:
    return _default_inv_freq(s, dim) / s.factor


def _dynamic_inv_freq(s: RopeScaling, dim: int, seq_len: int | None = None) -> torch.Tensor:
    original = s.original_max_position_embeddings
    if seq_len is None or seq_len <= original:
        return _default_inv_freq(s, dim)
    # transformers grows theta with seq_len as a 0-d int64 tensor, so in float32: do the same to match it.
    seq = torch.tensor(seq_len)
    theta = s.theta * ((s.factor * seq / original) - (s.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(s: RopeScaling, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(s, dim)
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(s: RopeScaling, dim: int) -> torch.Tensor:
    pos_freqs = s.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    low, high = _yarn_correction_range(s, dim)
    extrapolated = 1 - _linear_ramp(low, high, dim // 2)
    return interpolation * (1 - extrapolated) + extrapolation * extrapolated


def _yarn_correction_range(s: RopeScaling, dim: int) -> tuple[float, float]:
    """The dimensions between full extrapolation (beta_fast rotations) and full interpolation (beta_slow)."""

    def dim_of(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(s.theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, n: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # as transformers: no division by zero
    return torch.clamp((torch.arange(n, dtype=torch.float32) - low) / (high - low), 0, 1)


def _longrope_inv_freq(s: RopeScaling, dim: int) -> torch.Tensor:
    """transformers' order of operations: 1 / (factor x theta^(2i/d))."""
    factors = torch.tensor(s.long_factor if s.long_context else s.short_factor, dtype=torch.float32)
    return 1.0 / (factors * s.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def longrope_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's default cos/sin magnitude: sqrt(1 + ln(factor) / ln(original context)), 1 without scaling."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


_INV_FREQ = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "dynamic": _dynamic_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
    "longrope": _longrope_inv_freq,
}


def _with_freq_factors(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    if s.freq_factors is None:
        return inv_freq
    return inv_freq / torch.tensor(s.freq_factors, dtype=torch.float32)


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's default cos/sin magnitude: 0.1 ln(factor) + 1, or the ratio of the two mscale forms."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _attention_factor(s: RopeScaling) -> float:
    if s.kind not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.kind == "longrope":
        return longrope_attention_factor(s.factor, s.original_max_position_embeddings)
    return yarn_attention_factor(s.factor, s.mscale, s.mscale_all_dim)


# --- readers ---

def rope_from_hf_config(raw: Mapping[str, Any]) -> RopeScaling:
    """The RoPE of a config.json: `rope_theta` + `rope_scaling` (old) or `rope_parameters` (transformers 5)."""
    # transformers takes rope_scaling over rope_parameters, and the dict's rope_theta over the top-level one.
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_scaling must be an object, got {params!r}")
    nested = sorted(key for key, value in params.items() if isinstance(value, Mapping))
    if nested:
        raise UnsupportedModelError(
            f"RoPE parameters per layer type ({', '.join(nested)}) are not supported; one flat dict is"
        )
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in KINDS:
        raise UnsupportedModelError(f"RoPE type {kind!r} is not supported (supported: {', '.join(KINDS)})")
    theta = _first(params.get("rope_theta"), raw.get("rope_theta"), 10000.0)
    if kind == "default":
        return RopeScaling(theta=theta)
    if kind == "linear":
        return RopeScaling(theta=theta, kind=kind, factor=_required(params, "factor", kind))
    if kind == "dynamic":
        return RopeScaling(theta=theta, kind=kind, factor=_required(params, "factor", kind),
                           original_max_position_embeddings=_max_positions(raw, kind))
    # a top-level original_max_position_embeddings wins over the dict's (transformers' Phi3 rule)
    original = _first(raw.get("original_max_position_embeddings"), params.get("original_max_position_embeddings"))
    original = _max_positions(raw, kind) if original is None else original
    if kind == "longrope":  # transformers' factor: max_position_embeddings / the original when not given
        factor = params.get("factor") or _max_positions(raw, kind) / original
        return RopeScaling(theta=theta, kind=kind, factor=factor, original_max_position_embeddings=original,
                           short_factor=tuple(_required(params, "short_factor", kind)),
                           long_factor=tuple(_required(params, "long_factor", kind)),
                           attention_factor=params.get("attention_factor"))
    if kind == "llama3":
        return RopeScaling(
            theta=theta, kind=kind, factor=_required(params, "factor", kind), original_max_position_embeddings=original,
            low_freq_factor=_required(params, "low_freq_factor", kind),
            high_freq_factor=_required(params, "high_freq_factor", kind),
        )
    factor = params.get("factor")
    return RopeScaling(
        theta=theta, kind=kind, original_max_position_embeddings=original,
        factor=_max_positions(raw, kind) / original if factor is None else factor,
        beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
        attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), truncate=params.get("truncate", True),
    )


def hf_rotary_dims(raw: Mapping[str, Any], head_dim: int) -> int:
    """The dimensions of each head a config.json's RoPE rotates: head_dim x partial_rotary_factor (transformers'
    rule, the dict's factor over the top-level one), 0 for the whole head."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    params = params if isinstance(params, Mapping) else {}  # rope_from_hf_config names that error
    partial = _first(params.get("partial_rotary_factor"), raw.get("partial_rotary_factor"), 1.0)
    if not _is_number(partial) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    dims = int(head_dim * partial)
    return 0 if dims == head_dim else dims


def rope_from_gguf(metadata: Mapping[str, Any], arch: str, freq_factors: Sequence[float] | None,
                   yarn_truncate: bool = True,
                   longrope_factors: tuple[Sequence[float], Sequence[float]] | None = None) -> RopeScaling:
    """The RoPE of a GGUF file from llama.cpp's `{arch}.rope.*` keys and its `rope_freqs.weight` values.

    A Llama 3.x file has no scaling type but per-frequency divisors: kind "default" with `freq_factors`. A LongRoPE
    file (Phi-3's converter) has its (short, long) factors as tensors (`longrope_factors`), the original context as
    rope.scaling.original_context_length and the cos/sin magnitude as rope.scaling.attn_factor.
    `yarn_truncate`: YaRN's correction range rounded to whole dimensions (llama.cpp's rule; the file does not say,
    the family does: gpt-oss was trained without the rounding).
    """

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.rope.{name}")
        return default if value is None else value

    theta = key("freq_base", 10000.0)
    factors = None if freq_factors is None else tuple(float(f) for f in freq_factors)
    kind = key("scaling.type", "linear")  # llama.cpp's default: a factor alone means linear
    if kind not in GGUF_KINDS:
        raise UnsupportedModelError(
            f"{arch}.rope.scaling.type {kind!r} is not supported (supported: {', '.join(GGUF_KINDS)})"
        )
    factor = key("scaling.factor") or key("scale_linear") or 1.0  # 0 means none, as in llama.cpp
    attn_factor = key("scaling.attn_factor", 1.0)
    if longrope_factors is not None:
        original = key("scaling.original_context_length") or metadata.get(f"{arch}.context_length")
        short, long = (tuple(float(f) for f in factors) for factors in longrope_factors)
        return RopeScaling(theta=theta, kind="longrope", original_max_position_embeddings=original,
                           short_factor=short, long_factor=long, attention_factor=attn_factor)
    if kind != "yarn" and attn_factor != 1.0:
        raise UnsupportedModelError(f"{arch}.rope.scaling.attn_factor={attn_factor} is only supported with yarn")
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return RopeScaling(theta=theta, freq_factors=factors)
    if kind == "linear":
        return RopeScaling(theta=theta, kind="linear", factor=factor, freq_factors=factors)
    return _yarn_from_gguf(key, metadata, arch, theta, factor, attn_factor, factors, yarn_truncate)


def _yarn_from_gguf(key, metadata, arch, theta, factor, attn_factor, factors, truncate: bool) -> RopeScaling:
    ext_factor = key("scaling.yarn_ext_factor", -1.0)
    if ext_factor >= 0 and ext_factor != 1.0:  # negative: unset, which llama.cpp makes 1.0 for yarn
        raise UnsupportedModelError(f"{arch}.rope.scaling.yarn_ext_factor={ext_factor} is not supported (only 1.0)")
    # llama.cpp reads a log multiplier as mscale_all_dim with mscale 1 (its non-DeepSeek rule)
    log_mul = key("scaling.yarn_log_multiplier", 0.0)
    mscale, mscale_all_dim = (1.0, float(log_mul)) if log_mul else (None, None)
    # The converter writes transformers' attention_factor as yarn_attn_factor: honoured as transformers does.
    attention = key("scaling.yarn_attn_factor")
    if attn_factor != 1.0:  # llama.cpp multiplies the whole magnitude by it
        if attention is None:
            attention = yarn_attention_factor(factor, mscale, mscale_all_dim)
        attention *= attn_factor
    original = key("scaling.original_context_length") or metadata.get(f"{arch}.context_length")
    return RopeScaling(
        theta=theta, kind="yarn", factor=factor, original_max_position_embeddings=original,
        beta_fast=key("scaling.yarn_beta_fast", 32.0), beta_slow=key("scaling.yarn_beta_slow", 1.0),
        attention_factor=attention, mscale=mscale, mscale_all_dim=mscale_all_dim, freq_factors=factors,
        truncate=truncate,
    )


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _required(params: Mapping[str, Any], name: str, kind: str) -> Any:
    if params.get(name) is None:
        raise ValueError(f"RoPE type {kind!r} needs rope_scaling.{name}, which the config does not give")
    return params[name]


def _max_positions(raw: Mapping[str, Any], kind: str) -> int:
    if raw.get("max_position_embeddings") is None:
        raise ValueError(f"RoPE type {kind!r} needs max_position_embeddings, which the config does not give")
    return raw["max_position_embeddings"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_numbers(name: str, values: Any) -> tuple[float, ...]:
    try:
        factors = tuple(float(f) for f in values)
    except TypeError:
        factors = ()
    if not factors or not all(math.isfinite(f) and f > 0 for f in factors):
        raise ValueError(f"RopeScaling.{name} must be positive numbers, got {values!r}")
    return factors


def _check_positive(name: str, value: Any) -> None:
    if not _is_number(value) or value <= 0:
        raise ValueError(f"RopeScaling.{name} must be a positive number, got {value!r}")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of x [n_tokens, n_heads, head_dim] (the Hugging Face layout); with cos, sin
    narrower than the head (partial RoPE), pairs of its first d dimensions alone, the rest as they are."""
    rotated_dims = cos.shape[-1]
    if rotated_dims < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated_dims], cos, sin), x[..., rotated_dims:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
