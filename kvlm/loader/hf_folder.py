"""A Hugging Face model folder: config.json, and *.safetensors tensors under GGUF names, checked before any is read."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from safetensors import SafetensorError, safe_open

from kvlm.core.errors import ModelFileError, UnsupportedModelError
from kvlm.core.family import ATTENTION, CONV, GATED_DELTA, SLIDING
from kvlm.families import family_for_hf
from kvlm.core.config import ModelConfig
from kvlm.loader.tensors import HFSource, SafetensorsTensors
from kvlm.loader.weights import ModelWeights, fused_parts, stored_shapes
from kvlm.core import rope

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
# Options of config.json that change the architecture in ways kvlm does not implement: refused, not ignored.
_UNSUPPORTED_OPTIONS = ("attention_bias", "mlp_bias", "use_sliding_window", "attn_logit_softcapping",
                        "use_bidirectional_attention", "conv_bias")
_HF_LAYER_KINDS = {"full_attention": ATTENTION, "sliding_attention": SLIDING, "conv": CONV,
                   "linear_attention": GATED_DELTA}
# A multimodal folder's language model: its config under text_config, its tensors under model.language_model
_TEXT_PREFIX = "model.language_model."
_TOWERS = ("vision_config", "audio_config")
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
log = logging.getLogger(__name__)


def open_hf_folder(folder: str | Path) -> tuple[ModelConfig, ModelWeights]:
    """Config and weights (to be read one at a time); every tensor's presence and shape is checked from the
    safetensors headers before any is read."""
    folder = Path(folder)
    config = config_from_hf(folder)
    family = config.family
    headers = [(file, name, shape, dtype) for file in sorted(folder.glob("*.safetensors"))
               for name, shape, dtype in _tensor_headers(file)]
    found = {gguf_name(name, family): (HFSource(((file, name),)), _as_gguf_shape(shape), dtype)
             for file, name, shape, dtype in headers}
    found.update(_expert_tensors(headers, family))
    fused = fused_parts(config)
    shapes = stored_shapes(config, fused)
    for name, shape in shapes.items():
        _check_shape(folder, found.get(name), name, shape, family)
    convert = {}
    for name in shapes:
        if family.hf_norm_offset and name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
            # stored as w - offset, multiplied as offset + w: GGUF files store the sum (a gated norm is a plain weight)
            convert[name] = lambda w, offset=family.hf_norm_offset: w + offset
        for suffix, function in family.hf_values:
            if name.endswith(suffix):
                convert[name] = function
    tensors = SafetensorsTensors({name: found[name][0] for name in shapes}, convert, shapes,
                                 {name: _DTYPE_NAMES.get(found[name][2], "float32") for name in shapes})
    return config, ModelWeights(config, tensors, fused=fused)


def config_from_hf(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{path}: cannot read the model config ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    family = family_for_hf(raw, path)
    raw = _text_config(raw, path)
    quantization = (raw.get("quantization_config") or {}).get("quant_method")
    if quantization is not None and not (quantization == "mxfp4" and family.hf_experts_interleaved):
        raise UnsupportedModelError(f"{path}: weights quantized by {quantization!r} in a Hugging Face folder are not "
                                    f"supported (its GGUF file is: llama.cpp's converter keeps MXFP4 experts as they are)")
    for option in _UNSUPPORTED_OPTIONS:
        if option == "attention_bias" and family.output_bias:  # biases on all four projections: the family's own
            continue
        if option == "use_bidirectional_attention" and raw.get(option) == "vision":  # image tokens only: none here
            continue
        if raw.get(option):
            raise UnsupportedModelError(f"{path}: {option}={raw[option]!r} is not supported for {family.name} models")
    try:
        layers = family.hf_config(raw) if family.hf_config else {
            **_attention_layers(raw, family), **(family.hf_options(raw) if family.hf_options else {})}
        return ModelConfig(
            architecture=family.name,
            name=raw.get("_name_or_path") or folder.name,
            n_layer=raw["num_hidden_layers"],
            n_embd=raw["hidden_size"],
            vocab_size=raw["vocab_size"],
            n_ctx_train=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            pooling=_pooling(folder),
            **layers,
        )
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from None
    except KeyError as exc:
        raise ModelFileError(f"{path}: the config has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:  # values of the wrong type, or ones ModelConfig rejects
        raise ModelFileError(f"{path}: the config describes an invalid model: {exc}") from exc


def _pooling(folder: Path) -> str:
    """The pooling a sentence-transformers folder names (1_Pooling/config.json); "last" where it names none."""
    try:
        modes = json.loads((folder / "1_Pooling" / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "last"
    for key, pooling in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                         ("pooling_mode_cls_token", "cls")):
        if modes.get(key) is True:
            return pooling
    return "last"


def _text_config(raw: dict, path: Path) -> dict:
    """A multimodal folder's language model config (its text_config, with the folder's architectures); the vision
    or audio towers beside it are not loaded: kvlm reads text only, and says so."""
    if not isinstance(raw.get("text_config"), dict):
        return raw
    towers = [name.removesuffix("_config") for name in _TOWERS if raw.get(name)]
    if towers:
        log.warning("%s: not loaded: this multimodal model's %s (kvlm runs its language model on text only)", path,
                    " and ".join(f"{tower} tower" for tower in towers))
    return {**raw["text_config"], "architectures": raw.get("architectures"),
            **({"quantization_config": raw["quantization_config"]} if "quantization_config" in raw else {})}


def _attention_layers(raw: dict, family) -> dict:
    """The ModelConfig fields of a decoder of attention (and conv) layers with MLPs."""
    n_head = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or family.default_head_dim or raw["hidden_size"] // max(n_head, 1)
    # a model with experts on every layer (Qwen3.5-MoE) may have no plain MLP width
    n_ff = raw.get("intermediate_size", 0) if raw.get("num_experts") else raw["intermediate_size"]
    return {"n_ff": family.hf_ff_size(raw) if family.hf_ff_size else n_ff, "n_head": n_head,
            "n_head_kv": raw.get("num_key_value_heads") or n_head, "head_dim": head_dim,
            "rms_norm_eps": float(raw.get("rms_norm_eps", raw.get("norm_eps", 1e-6))),
            **_attention_options(raw, family, head_dim), **_expert_options(raw, family)}


def _expert_options(raw: dict, family) -> dict:
    """The mixture-of-experts fields as transformers reads them (none for a model without experts)."""
    n_expert = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if not n_expert:
        return {}
    if raw.get("model_type") == "mixtral" and raw.get("sliding_window"):
        raise UnsupportedModelError(f"sliding_window={raw['sliding_window']!r} is not supported for mixtral models")
    if raw.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"clip_qkv={raw['clip_qkv']!r} is not supported for {family.name} models")
    dense = set(raw.get("mlp_only_layers") or ())
    step = raw.get("decoder_sparse_step") or 1
    norm = family.hf_expert_weights_norm
    activation = {"swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)), "swiglu_limit": float(raw.get("swiglu_limit", 7.0))}
    return {**(activation if family.activation == "swiglu_oai" else {}),
            "n_expert": n_expert, "n_expert_used": raw["num_experts_per_tok"],
            "n_ff_exp": raw.get("moe_intermediate_size") or raw["intermediate_size"],
            "n_ff_shexp": raw.get("shared_expert_intermediate_size") or raw.get("shared_intermediate_size") or 0,
            "expert_weights_norm": bool(raw.get("norm_topk_prob", False)) if norm is None else norm,
            "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(raw["num_hidden_layers"]))}


def _attention_options(raw: dict, family, head_dim: int) -> dict:
    """RoPE, sliding windows, query scale and logit cap, as transformers reads them for the family."""
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    # gpt-oss's config names its clamped SwiGLU's gate activation, silu
    expected = "silu" if family.activation == "swiglu_oai" else family.activation
    if _HF_ACTIVATIONS.get(activation) != expected:
        raise UnsupportedModelError(f"hidden activation {activation!r} is not supported for {family.name} models "
                                    f"(it uses {family.activation})")
    options = {"final_logit_softcap": float(raw.get("final_logit_softcapping") or 0.0)}
    if raw.get("query_pre_attn_scalar") is not None:
        options["query_scale"] = (head_dim / raw["query_pre_attn_scalar"]) ** 0.5
    layer_types = raw.get("layer_types") or _interval_layer_types(raw)
    unknown = sorted(set(layer_types) - _HF_LAYER_KINDS.keys())
    if unknown:
        raise UnsupportedModelError(
            f"layer types {unknown} are not supported (supported: {', '.join(_HF_LAYER_KINDS)})")
    if layer_types:
        options["layer_kinds"] = tuple(_HF_LAYER_KINDS[kind] for kind in layer_types)
    if "conv" in layer_types:
        options["conv_kernel"] = raw["conv_L_cache"]
    if "linear_attention" in layer_types:
        options.update(_gated_delta_options(raw))
    options["rope_dims"] = rope.hf_rotary_dims(raw, head_dim)
    if "sliding_attention" not in layer_types:  # Qwen's configs list their layers too, all full
        return {**options, "rope": rope.rope_from_hf_config(raw)}
    per_kind = raw.get("rope_parameters") or {}
    attention_kinds = ("full_attention", "sliding_attention")
    if all(isinstance(per_kind.get(kind), dict) for kind in attention_kinds):  # transformers 5: a dict per kind
        full, local = (rope.rope_from_hf_config({**raw, "rope_parameters": per_kind[kind], "rope_scaling": None})
                       for kind in attention_kinds)
    else:  # older: rope_theta and rope_scaling for full layers, rope_local_base_freq for sliding ones
        full = rope.rope_from_hf_config(raw)
        local = rope.RopeScaling(theta=raw.get("rope_local_base_freq", 10000.0)) if family.sliding_rope_base else None
    return {**options, "rope": full, "rope_local": local, "sliding_window": raw.get("sliding_window") or 0}


def _interval_layer_types(raw: dict) -> list[str]:
    """Qwen3.5's layer kinds when config.json does not list them: every full_attention_interval-th layer attends
    fully, the others are linear (transformers' default interval: 4)."""
    if "linear_num_value_heads" not in raw:
        return []
    interval = raw.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(raw["num_hidden_layers"])]


def _gated_delta_options(raw: dict) -> dict:
    """Qwen3.5's linear-attention sizes as ModelConfig reads them (see ModelConfig.ssm_heads)."""
    heads = raw["linear_num_value_heads"]
    return {"conv_kernel": raw.get("linear_conv_kernel_dim", 4), "ssm_state": raw["linear_key_head_dim"],
            "ssm_groups": raw["linear_num_key_heads"], "ssm_heads": heads,
            "ssm_inner": heads * raw["linear_value_head_dim"]}


def text_model_name(hf_name: str) -> str:
    """A multimodal folder's language-model tensor under the name a text-only folder gives it."""
    return "model." + hf_name.removeprefix(_TEXT_PREFIX) if hf_name.startswith(_TEXT_PREFIX) else hf_name


def gguf_name(hf_name: str, family=None) -> str:
    hf_name = text_model_name(hf_name)
    stem, _, kind = hf_name.rpartition(".")
    global_names = _global_names(family)
    if stem in global_names:
        return f"{global_names[stem]}.{kind}"
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    names = _layer_names(family)
    if len(parts) < 4 or parts[:2] != [family.hf_prefix if family else "model", "layers"]:
        return hf_name
    part, _, kind = parts[3].rpartition(".")
    if parts[3] in names:  # a tensor named as a whole (Mamba2's A_log)
        return f"blk.{parts[2]}.{names[parts[3]]}"
    return f"blk.{parts[2]}.{names[part]}.{kind}" if part in names else hf_name


def hf_name(name: str, family=None) -> str:
    """The Hugging Face name of a GGUF tensor name: what errors about a folder should say."""
    stem, _, kind = name.rpartition(".")
    hf_global_names = {gguf: hf for hf, gguf in _global_names(family).items()}
    if stem in hf_global_names:
        return f"{hf_global_names[stem]}.{kind}"
    parts = name.split(".", 2)  # blk, N, part
    names = {gguf: hf for hf, gguf in _layer_names(family).items()}
    prefix = family.hf_prefix if family else "model"
    if len(parts) < 3 or parts[0] != "blk":
        return name
    if parts[2] in names:
        return f"{prefix}.layers.{parts[1]}.{names[parts[2]]}"
    part, _, kind = parts[2].rpartition(".")
    return f"{prefix}.layers.{parts[1]}.{names[part]}.{kind}" if part in names else name


def _global_names(family) -> dict[str, str]:
    return _GLOBAL_NAMES if family is None else {**_GLOBAL_NAMES, **dict(family.hf_global_names)}


def _as_gguf_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A depthwise Conv1d weight [channels, 1, width] is GGUF's [channels, width]."""
    return (shape[0], shape[2]) if len(shape) == 3 and shape[1] == 1 else shape


def _layer_names(family) -> dict[str, str]:
    """Hugging Face layer parts to GGUF ones: Llama's, with the family's own where they differ."""
    return _LAYER_NAMES if family is None else {**_LAYER_NAMES, **dict(family.hf_layer_names)}


_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "MXFP4": "MXFP4"}


def _tensor_headers(file: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """Names, shapes and dtypes from a safetensors header, without reading any data."""
    try:
        with safe_open(file, "pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return [(name, tuple(part.get_shape()), part.get_dtype()) for name, part in slices.items()]
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{file}: not a readable safetensors file ({exc})") from exc


def _check_shape(folder: Path, found, name: str, shape: tuple[int, ...], family) -> None:
    if found is None:
        raise ModelFileError(f"{folder}: tensor {hf_name(name, family)} is missing (expected shape {list(shape)})")
    if found[1] != shape:
        raise ModelFileError(
            f"{folder}: tensor {hf_name(name, family)} has shape {list(found[1])}, expected {list(shape)}")


# Experts' tensors: one per expert (transformers' files: experts.N.gate_proj, Mixtral's experts.N.w1), stacked on
# read; or all experts in one, gate and up projections stacked by rows (transformers 5's experts.gate_up_proj,
# Granite's input_linear), each half read as its own tensor.
_PER_EXPERT = re.compile(r"(?P<layer>\w+\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}
_STACKED = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
            "experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "experts.down_proj": ("ffn_down_exps",),  # Gemma 4
            "block_sparse_moe.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
            "block_sparse_moe.input_linear.weight": ("ffn_gate_exps", "ffn_up_exps"),
            "shared_mlp.input_linear.weight": ("ffn_gate_shexp", "ffn_up_shexp"),
            "mlp.experts.down_proj": ("ffn_down_exps",), "block_sparse_moe.experts.down_proj": ("ffn_down_exps",)}


# gpt-oss: each layer's experts as [expert, in, out] tensors, gate and up columns interleaved (gate even, up odd),
# biases [expert, out] beside them.
_INTERLEAVED = {"mlp.experts.gate_up_proj": (("ffn_gate_exps", "ffn_up_exps"), "weight"),
                "mlp.experts.down_proj": (("ffn_down_exps",), "weight"),
                "mlp.experts.gate_up_proj_bias": (("ffn_gate_exps", "ffn_up_exps"), "bias"),
                "mlp.experts.down_proj_bias": (("ffn_down_exps",), "bias")}


_MXFP4_PARTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "mlp.experts.down_proj": ("ffn_down_exps",)}


def _mxfp4_tensors(found: dict[tuple[str, str], dict[str, tuple]]) -> dict:
    """gpt-oss's MXFP4 experts (OpenAI's folders): `found[(layer, part)]` holds the `blocks` [expert, out, in / 32,
    16] and `scales` [expert, out, in / 32] headers (file, name, shape) of each; as the GGUF tensors they hold, gate
    and up rows interleaved as in the unquantized form."""
    tensors = {}
    for (index, part), pair in found.items():
        if set(pair) != {"blocks", "scales"}:
            file, name, _ = next(iter(pair.values()))
            raise ModelFileError(f"{file}: {name} has no {({'blocks', 'scales'} - set(pair)).pop()} beside it")
        (file, blocks, shape), scales = pair["blocks"], pair["scales"]
        targets = _MXFP4_PARTS[part]
        for which, target in enumerate(targets):
            source = HFSource(((file, blocks),), which if len(targets) > 1 else None, scales=scales[:2])
            tensors[f"blk.{index}.{target}.weight"] = (source, (shape[0], shape[1] // len(targets), shape[2] * 32),
                                                       "MXFP4")
    return tensors


def _interleaved_tensors(file: Path, name: str, shape: tuple, dtype: str, index: str, part: str) -> dict:
    """A gpt-oss experts tensor as the GGUF tensors it holds: its halves (gate, up) or itself, [expert, out, in]."""
    targets, kind = _INTERLEAVED[part]
    out = shape[-1] // len(targets)
    target_shape = (shape[0], out, shape[1]) if kind == "weight" else (shape[0], out)
    return {f"blk.{index}.{target}.{kind}": (HFSource(((file, name),), which if len(targets) > 1 else None, True),
                                             target_shape, dtype)
            for which, target in enumerate(targets)}


def _expert_tensors(headers: list, family) -> dict[str, tuple[HFSource, tuple[int, ...], str]]:
    """GGUF name -> (where, shape, dtype) of the experts' tensors among the folder's (name, shape, dtype) headers."""
    per_expert: dict[str, dict[int, tuple]] = {}
    mxfp4: dict[tuple[str, str], dict[str, tuple]] = {}
    tensors = {}
    for file, name, shape, dtype in headers:
        match = _PER_EXPERT.fullmatch(text_model_name(name))
        layer, _, rest = text_model_name(name).partition(".layers.")
        index, _, part = rest.partition(".")
        if match:
            target = f"blk.{index}.{_EXPERT_PARTS[match['part']]}.weight"
            per_expert.setdefault(target, {})[int(match["expert"])] = (file, name, tuple(shape), dtype)
        elif layer == family.hf_prefix and family.hf_experts_interleaved and part in _INTERLEAVED:
            tensors.update(_interleaved_tensors(file, name, tuple(shape), dtype, index, part))
        elif layer == family.hf_prefix and family.hf_experts_interleaved and part.endswith(("_blocks", "_scales")):
            stem, _, kind = part.rpartition("_")
            if stem in _MXFP4_PARTS:
                mxfp4.setdefault((index, stem), {})[kind] = (file, name, tuple(shape))
        elif layer == family.hf_prefix and part in _STACKED:
            halves = _STACKED[part]
            half_shape = (*shape[:-2], shape[-2] // len(halves), shape[-1])
            for which, target in enumerate(halves):
                source = HFSource(((file, name),), which if len(halves) > 1 else None)
                tensors[f"blk.{index}.{target}.weight"] = (source, half_shape, dtype)
    tensors.update(_mxfp4_tensors(mxfp4))
    for target, experts in per_expert.items():
        ordered = [experts[e] for e in sorted(experts)]
        shapes = {shape for _, _, shape, _ in ordered}
        if sorted(experts) != list(range(len(experts))) or len(shapes) != 1:
            raise ModelFileError(f"{ordered[0][0].parent}: the experts of {target} are not numbered 0..n-1 with one "
                                 f"shape (found experts {sorted(experts)}, shapes {sorted(shapes)})")
        source = HFSource(tuple((file, name) for file, name, _, _ in ordered))
        tensors[target] = (source, (len(ordered), *shapes.pop()), ordered[0][3])
    return tensors
