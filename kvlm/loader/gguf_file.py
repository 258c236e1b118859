"""A GGUF file's ModelConfig, and its tensors checked against it (every one present, of its shape, whole) before
any is read."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvlm.core.errors import ModelFileError, UnsupportedModelError
from kvlm.core.family import ATTENTION, CONV, GATED_DELTA, family_named
from kvlm.core.config import GGUF_POOLING_TYPES, ModelConfig
from kvlm.kernels.blocks import NATIVE_TYPES
from kvlm.loader.gguf_reader import GGUFFile, TensorInfo
from kvlm.loader.gguf_split import SplitGGUF, open_gguf
from kvlm.loader.tensors import FLOAT_TYPES, ExpertParts, GGUFTensors
from kvlm.loader.weights import ModelWeights, fused_parts, stored_shapes
from kvlm.core import rope

ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x: per-dimension divisors of the RoPE frequencies
LONGROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # LongRoPE's two sets of divisors


def open_gguf_model(path: str | Path) -> tuple[ModelConfig, ModelWeights, dict[str, Any]]:
    """Config, weights (to be read one at a time) and raw metadata of a GGUF model file (all its parts, for a split
    model given by any of them).

    Every tensor's presence, shape and size is checked here; none is read yet.
    """
    gguf = open_gguf(path)
    config = _config_of(gguf, path)
    family = config.family
    renamed = {ours: theirs for ours, theirs in family.gguf_names if theirs in gguf.tensors}
    renamed.update({f"blk.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight" for ours, theirs in family.gguf_layer_names
                    for i in range(config.n_layer)})
    permuted = {"attn_q.weight": config.n_head, "attn_k.weight": config.n_head_kv} if family.permuted_qk else {}
    experts = _expert_parts(gguf, config)
    tensors = GGUFTensors(gguf, renamed, permuted, experts)
    fused = fused_parts(config)
    for name, shape in stored_shapes(config, fused).items():
        if name in experts:
            _check_expert_parts(gguf, experts[name], name, shape)
            continue
        info = gguf.tensors.get(renamed.get(name, name))
        _check_tensor(gguf, info, name, shape, reshaped=name.endswith(family.gguf_reshaped))
    return config, ModelWeights(config, tensors, fused=fused), gguf.metadata


def read_gguf_config(path: str | Path) -> ModelConfig:
    return read_gguf_summary(path)[0]


def read_gguf_summary(path: str | Path) -> tuple[ModelConfig, dict[str, str]]:
    """The config and each tensor's stored type (e.g. "Q4_K"), without reading any weights."""
    gguf = open_gguf(path)
    return _config_of(gguf, path), {name: info.qtype.name for name, info in gguf.tensors.items()}


def _config_of(gguf: GGUFFile | SplitGGUF, path: str | Path) -> ModelConfig:
    freq_factors = _vector(gguf, ROPE_FREQS)
    longrope = tuple(_vector(gguf, name) for name in LONGROPE_FACTORS)
    return config_from_metadata(gguf.metadata, path, tied="output.weight" not in gguf.tensors,
                                freq_factors=freq_factors, tensor_names=frozenset(gguf.tensors),
                                longrope_factors=None if None in longrope else longrope)


def _vector(gguf: GGUFFile | SplitGGUF, name: str) -> list[float] | None:
    """A small tensor of the file's RoPE (complete, any length) as numbers; None where the file has none."""
    info = gguf.tensors.get(name)
    if info is None:
        return None
    _check_tensor(gguf, info, name, (info.n_elements,))
    return GGUFTensors(gguf).read(name).float().reshape(-1).tolist()


def config_from_metadata(
    metadata: dict[str, Any], path: str | Path, *, tied: bool, freq_factors: list[float] | None = None,
    tensor_names: frozenset[str] = frozenset(), longrope_factors: tuple[list[float], list[float]] | None = None,
) -> ModelConfig:
    arch = metadata.get("general.architecture")
    family = family_named(arch, path)

    def key(suffix: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ModelFileError(f"{path}: metadata key {arch}.{suffix} is missing")
        return value

    try:
        n_embd, n_layer = int(key("embedding_length")), int(key("block_count"))
        vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
        layers = family.gguf_config(key, tensor_names) if family.gguf_config else {
            **_attention_layers(metadata, key, family), **_expert_options(metadata, key, family, tensor_names),
            **(family.gguf_options(key, tensor_names) if family.gguf_options else {})}
        config = ModelConfig(
            architecture=arch,
            name=str(metadata.get("general.name", Path(path).stem)),
            n_layer=n_layer,
            n_embd=n_embd,
            vocab_size=int(vocab),
            n_ctx_train=int(key("context_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings=tied,
            pooling=GGUF_POOLING_TYPES.get(int(metadata.get(f"{arch}.pooling_type") or 0), "last"),
            rope=rope.rope_from_gguf(metadata, arch, freq_factors, yarn_truncate=family.gguf_yarn_truncate,
                                     longrope_factors=longrope_factors),
            **layers,
        )
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from None
    except (TypeError, ValueError) as exc:  # values of the wrong type, or ones ModelConfig rejects
        raise ModelFileError(f"{path}: the metadata describes an invalid model: {exc}") from exc
    if config.rope_dims and family.permuted_qk:
        raise UnsupportedModelError(f"{path}: {arch}.rope.dimension_count={config.rope_dims} rotates part of each "
                                    f"{config.head_dim}-dim head; {arch} files rotate whole heads")
    return config


def _sliding_options(metadata: dict[str, Any], arch: str, family) -> dict[str, Any]:
    """The window and the sliding layers' RoPE as llama.cpp reads them: only when the file gives a window, with
    the file's rope.freq_base_swa or else the 10000 llama.cpp sets for Gemma 3's local layers (for a family whose
    sliding layers have a RoPE of their own)."""
    window = int(metadata.get(f"{arch}.attention.sliding_window") or 0)
    if not (family.sliding_period and window > 0):
        return {}
    if not family.sliding_rope_base:
        return {"sliding_window": window}
    theta = float(metadata.get(f"{arch}.rope.freq_base_swa") or 10000.0)
    return {"sliding_window": window, "rope_local": rope.RopeScaling(theta=theta)}


def _attention_layers(metadata: dict[str, Any], key, family) -> dict[str, Any]:
    """The ModelConfig fields of a decoder of attention (and conv) layers with MLPs, as llama.cpp reads them."""
    arch = family.name
    n_embd, n_head, n_layer = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    head_dim = int(key("attention.key_length", n_embd // max(n_head, 1)))
    query_scale = family.gguf_query_scale(n_layer, n_embd, n_head, head_dim) if family.gguf_query_scale else 1.0
    # a model with experts on every layer (Qwen3.5-MoE) may have no plain MLP width
    experts = bool(metadata.get(f"{arch}.expert_count"))
    n_ff = int(metadata.get(f"{arch}.feed_forward_length") or 0) if experts else int(key("feed_forward_length"))
    return {"n_ff": n_ff, "n_head": n_head, "head_dim": head_dim,
            "n_head_kv": _kv_heads(key("attention.head_count_kv", n_head)), "query_scale": query_scale,
            "final_logit_softcap": float(metadata.get(f"{arch}.final_logit_softcapping") or 0.0),
            **_sliding_options(metadata, arch, family), **_conv_options(metadata, arch),
            **_gated_delta_options(metadata, key, arch, n_layer), "rope_dims": _rope_dims(metadata, arch, head_dim)}


# Routing that llama.cpp's files may ask for and kvlm does not implement: refused, not ignored.
_ROUTING_KEYS = {"expert_gating_func": (None, 1), "expert_weights_scale": (None, 0.0, 1.0), "expert_group_count": (None, 0, 1),
                 "expert_shared_count": (None, 0, 1)}


def _expert_options(metadata: dict[str, Any], key, family, tensor_names: frozenset[str]) -> dict[str, Any]:
    """The mixture-of-experts fields as llama.cpp reads them: a layer has experts where the file has its router
    (`ffn_gate_inp`); the chosen weights are renormalised as the file's expert_weights_norm says, else as llama.cpp
    does for the architecture."""
    arch = family.name
    n_expert = int(metadata.get(f"{arch}.expert_count") or 0)
    if not n_expert:
        return {}
    for suffix, supported in _ROUTING_KEYS.items():
        if metadata.get(f"{arch}.{suffix}") not in supported:
            raise UnsupportedModelError(f"{arch}.{suffix}={metadata[f'{arch}.{suffix}']!r} is not supported")
    biased = sorted(name for name in tensor_names if name.endswith("exp_probs_b.bias"))
    if biased:
        raise UnsupportedModelError(f"expert selection biases ({biased[0]}) are not supported")
    n_layer = int(key("block_count"))
    return {"n_expert": n_expert, "n_expert_used": int(key("expert_used_count")),
            "n_ff_exp": int(metadata.get(f"{arch}.expert_feed_forward_length") or key("feed_forward_length")),
            "n_ff_shexp": int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            "expert_weights_norm": bool(metadata.get(f"{arch}.expert_weights_norm", family.gguf_expert_weights_norm)),
            "moe_layers": tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(n_layer))}


def _kv_heads(value: Any) -> int:
    """head_count_kv, or of a per-layer list (LFM2's: 0 for layers without attention) its largest."""
    return int(max(value)) if isinstance(value, list) else int(value)


def _conv_options(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """LFM2's layer kinds as llama.cpp reads them: a layer with no KV heads is a short convolution."""
    heads = metadata.get(f"{arch}.attention.head_count_kv")
    kernel = metadata.get(f"{arch}.shortconv.l_cache")
    if kernel is None or not isinstance(heads, list):
        return {}
    return {"conv_kernel": int(kernel), "layer_kinds": tuple(CONV if n == 0 else ATTENTION for n in heads)}


def _gated_delta_options(metadata: dict[str, Any], key, arch: str, n_layer: int) -> dict[str, Any]:
    """Qwen3.5's layer kinds and linear-attention sizes as llama.cpp reads them: every full_attention_interval-th
    layer attends, the others are Gated DeltaNet layers; its value heads tiled (see ModelConfig.ssm_heads)."""
    interval = metadata.get(f"{arch}.full_attention_interval")
    heads = metadata.get(f"{arch}.ssm.time_step_rank")
    if interval is None or heads is None:
        return {}
    return {"layer_kinds": tuple(ATTENTION if (i + 1) % int(interval) == 0 else GATED_DELTA for i in range(n_layer)),
            "conv_kernel": int(key("ssm.conv_kernel")), "ssm_state": int(key("ssm.state_size")),
            "ssm_groups": int(key("ssm.group_count")), "ssm_heads": int(heads), "ssm_inner": int(key("ssm.inner_size")),
            "ssm_heads_tiled": True}


def _rope_dims(metadata: dict[str, Any], arch: str, head_dim: int) -> int:
    """The dimensions RoPE rotates (rope.dimension_count), 0 for the whole head. (A family whose Q/K rows llama.cpp
    permutes for its own RoPE layout, Llama's, rotates whole heads: config_from_metadata refuses others.)"""
    dims = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    return 0 if dims == head_dim else dims


def _expert_parts(gguf: GGUFFile | SplitGGUF, config: ModelConfig) -> dict[str, ExpertParts]:
    """Experts' tensors the file stores otherwise than as one tensor each: a fused gate/up (ffn_gate_up_exps), or
    one tensor per expert (older Mixtral files: ffn_gate.E, ffn_up.E, ffn_down.E)."""
    parts = {}
    for layer in (i for i, moe in enumerate(config.moe_layers) if moe):
        fused = gguf.tensors.get(f"blk.{layer}.ffn_gate_up_exps.weight")
        for half, part in enumerate(("gate", "up", "down")):
            name = f"blk.{layer}.ffn_{part}_exps.weight"
            if name in gguf.tensors:
                continue
            if fused is not None and part != "down":
                parts[name] = ExpertParts((fused,), half)
                continue
            each = [gguf.tensors.get(f"blk.{layer}.ffn_{part}.{e}.weight") for e in range(config.n_expert)]
            if all(each):
                parts[name] = ExpertParts(tuple(each))
    return parts


def _check_expert_parts(gguf: GGUFFile | SplitGGUF, parts: ExpertParts, name: str, shape: tuple[int, ...]) -> None:
    """Every part present and whole, of one type, making up the expected shape."""
    if parts.shape != shape or len({t.qtype for t in parts.tensors}) != 1:
        raise ModelFileError(f"{gguf.path}: tensor {name}, stored as {', '.join(t.name for t in parts.tensors[:3])}"
                             f"{'...' if len(parts.tensors) > 3 else ''}, has shape {list(parts.shape)} (types "
                             f"{sorted({t.qtype.name for t in parts.tensors})}), expected {list(shape)} of one type")
    for tensor in parts.tensors:
        gguf.check_complete(tensor)
    _check_readable(gguf, parts.tensors[0], name)


def _check_tensor(gguf: GGUFFile | SplitGGUF, info: TensorInfo | None, name: str, shape: tuple[int, ...],
                  reshaped: bool = False) -> None:
    """Present, of the expected shape (or, `reshaped`, as many values), and holding all its bytes."""
    path = gguf.path
    if info is None:
        raise ModelFileError(f"{path}: tensor {name} is missing (expected shape {list(shape)})")
    if (np.prod(info.shape) != np.prod(shape)) if reshaped else (info.shape != shape):
        raise ModelFileError(f"{path}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
    gguf.check_complete(info)
    _check_readable(gguf, info, name)


def _check_readable(gguf: GGUFFile | SplitGGUF, info: TensorInfo, name: str) -> None:
    """A type kvlm does not read (neither a float nor a block format of its kernels) is refused here, before any
    weight is read."""
    if info.qtype not in NATIVE_TYPES and info.qtype not in FLOAT_TYPES:
        raise ModelFileError(f"{gguf.path}: tensor {name} is stored as {info.qtype.name}, a type kvlm cannot read "
                             f"(it reads {', '.join(sorted(t.name for t in NATIVE_TYPES | FLOAT_TYPES.keys()))})")
