"""Tiny random Gemma 4 text models that transformers makes (never hub weights): the dense Gemma4ForCausalLM (8 layers
of 3 sliding-window layers then 1 full-attention layer, twice; the last 4 layers reading the KV of earlier ones; per-
layer embeddings; double-wide MLPs on the shared layers) and its MoE form (google's 26B-A4B's design: a router and 4
experts beside the dense MLP of every layer, keys doubling as values on the full layers, no sharing, no per-layer
embeddings). Written as a Hugging Face folder (what save_pretrained writes, or config.json as google's releases hold
it; also as the Gemma4ForConditionalGeneration folder the hub releases are, vision and audio towers included) and as
a GGUF file written as llama.cpp's converter writes one (conversion/gemma.py: Gemma4Model, arch "gemma4", built on
Gemma3Model and base.py's TextModel):
- names from the gguf package's own map; layer_scalar (a buffer of shape [1]) as blk.N.layer_output_scale.weight;
  the fused experts as transformers holds them (gate_up_proj [E, 2 ff, d], gate rows first) as ffn_gate_up_exps,
  down_proj as ffn_down_exps; router.scale as blk.N.ffn_gate_inp.scale, router.per_expert_scale as
  blk.N.ffn_down_exps.scale (a per-expert factor on the expert's output: the same thing);
- the norms NOT shifted (Gemma4Model.norm_shift is 0: Gemma 4's RMSNorm multiplies by w itself, unlike Gemma 3's
  1 + w), no Q/K row permutation;
- an extra rope_freqs.weight: 1 for the rotated frequencies of the full layers' "proportional" RoPE, 1e30 for the
  others (frequency / 1e30: not rotated); llama.cpp reads it on the full layers only;
- what transformers does not make, the file does not hold: shared layers have no attn_k / attn_v / attn_k_norm,
  k_eq_v full layers no attn_v, a tied model no output.weight;
- its metadata: per-layer feed_forward_length (double-wide) and head_count_kv (global KV heads), the full layers'
  head size as key_length / rope.dimension_count and the sliding ones' as the *_swa keys, both RoPE bases, the
  sliding pattern, shared_kv_layers, embedding_length_per_layer_input, final_logit_softcapping.
The tokenizer is the byte-level one the other factories write (gguf_factory), not Gemma 4's own "gemma4" vocabulary,
with pre-tokenizer "default" (llama.cpp refuses "gpt2"). The llama.cpp converter itself (its conversion/ and gguf-py,
Gemma4Model.set_vocab skipped, config.json in hub_text_config's form) writes these files' tensors (F32 and Q8_0) and
non-tokenizer metadata byte for byte, for every variant and from the multimodal folder too.

llama.cpp and transformers choose the layer a shared layer reads differently: transformers the last non-shared layer
of the same type (Gemma4TextConfig.kv_sharing_modes), llama.cpp n_kv - 2 for a sliding layer and n_kv - 1 for a full
one (n_kv: the first shared layer). They agree only when the last non-shared layer is a full one with a sliding one
before it, as in google's E2B (35 layers, the last 20 shared: producers 13, sliding, and 14, full): hence 4 shared
layers here (producers 2, sliding, and 3, full). With 3 (producers 4, sliding, and 3, full) llama.cpp aborts the
process while making its KV cache (GGML_ASSERT(map_layer_ids.find(il_reuse) != map_layer_ids.end())).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from helpers.gguf_factory import BOS_ID, EOS_ID, byte_level_tokenizer, gguf_metadata, save_hf_folder
from helpers.qwen35_factory import _write_gguf  # the converter's F32 / F16-fallback rules, the same prepare_tensors

F32 = GGMLQuantizationType.F32
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = ([SLIDING] * 3 + [FULL]) * 2
# The full layers' RoPE as google's releases set it: "proportional", 1/4 of the frequencies of a 64-dim head rotated
# (8 of 32, the other 24 zero: those dims unrotated), over NeoX halves of the whole head.
ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}}
_TEXT = dict(vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=64, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             # popped by Gemma4TextConfig.__post_init__ into per_layer_config (full layers only); the global KV heads
             # only where attention_k_eq_v (else the full layers keep num_key_value_heads)
             global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=False,
             layer_types=LAYER_TYPES, sliding_window=8, intermediate_size=96, hidden_size_per_layer_input=16,
             num_kv_shared_layers=4, use_double_wide_mlp=True, final_logit_softcapping=30.0,
             max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
             pad_token_id=BOS_ID)
_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
            num_kv_shared_layers=0, hidden_size_per_layer_input=0)
# Each small: enough to be a Gemma4ForConditionalGeneration, whose text part ignores them.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, position_embedding_size=16, pooling_kernel_size=2)
AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[16, 8],
             conv_kernel_size=3, output_proj_dims=48)


# --- the transformers models ---

def gemma4_config(**overrides) -> Gemma4TextConfig:
    """random_gemma4's config with `overrides` (e.g. attention_k_eq_v=True, hidden_size_per_layer_input=0,
    num_kv_shared_layers=0, use_double_wide_mlp=False, layer_types=...)."""
    rope = overrides.pop("rope_parameters", ROPE)
    layer_types = list(overrides.pop("layer_types", LAYER_TYPES))
    return Gemma4TextConfig(**{**_TEXT, **overrides, "layer_types": layer_types}, rope_parameters=copy.deepcopy(rope),
                            attn_implementation="eager")


def random_gemma4(seed: int = 0, **overrides) -> Gemma4ForCausalLM:
    """transformers' Gemma 4 (eval, float32, eager attention; dense unless `overrides` say otherwise), weights drawn
    by `_randomize`."""
    config = gemma4_config(**overrides)
    torch.manual_seed(seed)
    model = _randomize(Gemma4ForCausalLM(config).eval())
    if config.num_kv_shared_layers and not config.hidden_size_per_layer_input:
        # transformers 5.24 slices the inputs of the shared layers to the logits kept (an int, 0 by default: all)
        # and per_layer_inputs with them, None without per-layer embeddings: TypeError on any forward. The slicing
        # only saves work, so it is switched off.
        model.model._maybe_slice_kv_shared_inputs = _keep_kv_shared_inputs
    return model


def _keep_kv_shared_inputs(hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping, *_, **__):
    return hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping


def random_gemma4_moe(seed: int = 0, **overrides) -> Gemma4ForCausalLM:
    """The MoE form, as google's 26B-A4B: every layer's dense MLP plus, beside it, 4 experts (2 per token: softmax,
    the top 2 renormalised, times a per-expert scale) routed from the residual stream after attention; keys doubling
    as values on the full layers (1 global KV head against 2), no KV sharing, no per-layer embeddings."""
    return random_gemma4(seed, **{**_MOE, **overrides})


def _randomize(model):
    """Every RMSNorm weight (a plain multiplier in Gemma 4) and layer_scalar (a buffer, not a parameter: a reader
    that forgets it then differs) in [0.5, 1.5], but the query and key norms' in [0.2, 0.5]; the router's scale and
    per-expert scale in [0.5, 1.5], its projection normal(0, 0.3); the embeddings (word and per-layer) normal(0,
    0.1); every other matrix normal(0, 0.05). Gemma 4 does not scale its attention scores (scaling 1.0: q and k
    are RMS-normalised instead), so with q and k norms in [0.5, 1.5] a 64-dim head's scores spread over +-25 and
    the softmax is near an argmax, which amplifies rounding: transformers' float32 logits were 4e-5 (dense), 1.7e-4
    (k_eq_v) and 6.7e-4 (MoE) from its float64 ones over 100 tokens; at [0.2, 0.5] (scores of std ~1) 4e-6 to 8e-6
    for each variant (1.6e-5 for the MoE with per-layer embeddings and sharing on). The matrices' scale hardly
    matters: every sub-layer's output is RMS-normalised (post norms) before it is added. Over 150 tokens the
    router's 2nd and 3rd choices may still come within 1e-5 (relative) of each other: rounding flips them there."""
    with torch.no_grad():
        norms = {f"{name}.weight" for name, module in model.named_modules()
                 if isinstance(module, Gemma4RMSNorm) and module.with_scale}
        for name, param in model.named_parameters():
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                param.uniform_(0.2, 0.5)
            elif name in norms or name.endswith(("router.scale", "router.per_expert_scale")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("router.proj.weight"):
                param.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model


def attention_shape(config: Gemma4TextConfig, layer_type: str = FULL) -> tuple[int, int]:
    """The (head_dim, KV heads) of the layers of `layer_type`. transformers 5.24 keeps them per layer
    (config.per_layer_config[i]); config.head_dim and config.num_key_value_heads raise
    AmbiguousGlobalPerLayerAttributeError once the full layers' differ (config.to_dict() holds the sliding ones)."""
    layer = config.per_layer_config[config.layer_types.index(layer_type)]
    return layer.head_dim, layer.num_key_value_heads


# --- Hugging Face folders ---

def hub_text_config(config: Gemma4TextConfig) -> dict[str, Any]:
    """The text config as google's releases write it: global_head_dim and num_global_key_value_heads (null unless
    attention_k_eq_v, as in E2B / E4B; 2 against 8 in the 26B-A4B), where transformers 5.24's save_pretrained
    writes per_layer_config {"3": {"head_dim": 64}, ...} instead (Gemma4TextConfig pops both keys into it). The
    converter reads hparams["global_head_dim"]: it takes its hparams from AutoConfig.from_pretrained(...).to_dict()
    (config.json as is only when that fails), so under transformers 5.24 it stops with KeyError 'global_head_dim'
    on either form; given this form raw, it writes exactly write_gemma4_gguf's file."""
    text = {k: v for k, v in config.to_dict().items() if k not in ("per_layer_config", "transformers_version")}
    head_dim, n_kv = attention_shape(config)
    text["global_head_dim"] = head_dim
    text["num_global_key_value_heads"] = n_kv if config.attention_k_eq_v else None
    return text


def _rewrite_text_config(folder: Path, multimodal: bool, config: Gemma4TextConfig) -> None:
    file = Path(folder) / "config.json"
    saved = json.loads(file.read_text())
    hub = hub_text_config(config)
    if multimodal:
        saved["text_config"] = {**{k: v for k, v in hub.items() if k != "architectures"}, "model_type": "gemma4_text"}
    else:
        saved = {**{k: v for k, v in saved.items() if k != "per_layer_config"}, **hub}
    file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def save_gemma4_folder(model: Gemma4ForCausalLM, folder: Path, hub_config: bool = False) -> Path:
    """save_pretrained's folder (tensors model.layers.N..., the experts fused as experts.gate_up_proj /
    experts.down_proj, no lm_head.weight when tied, layer_scalar saved; config.json model_type "gemma4_text") with
    the byte-level tokenizer. `hub_config`: config.json in hub_text_config's form instead of per_layer_config."""
    save_hf_folder(model, folder)
    if hub_config:
        _rewrite_text_config(folder, False, model.config)
    return Path(folder)


def gemma4_multimodal_model(model: Gemma4ForCausalLM, seed: int = 0,
                            audio: bool = True) -> Gemma4ForConditionalGeneration:
    """A Gemma4ForConditionalGeneration holding `model`'s text weights, a tiny random vision tower and (`audio`) a
    tiny audio tower."""
    text = {k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "transformers_version")}
    config = Gemma4Config(text_config=text, vision_config=dict(VISION), audio_config=dict(AUDIO) if audio else None,
                          tie_word_embeddings=model.config.tie_word_embeddings)
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        vl = Gemma4ForConditionalGeneration(config).eval()
    vl.set_attn_implementation("eager")
    with torch.no_grad():
        vl.model.language_model.load_state_dict(model.model.state_dict())  # layer_scalar buffers included
        vl.lm_head.weight.copy_(model.lm_head.weight)
    if "_maybe_slice_kv_shared_inputs" in vars(model.model):  # random_gemma4's workaround, for the same model
        vl.model.language_model._maybe_slice_kv_shared_inputs = _keep_kv_shared_inputs
    return vl


def save_gemma4_multimodal_folder(model: Gemma4ForCausalLM, folder: Path, hub_config: bool = True,
                                  audio: bool = True) -> Path:
    """The same weights as the hub's Gemma 4 folders hold them: architectures ["Gemma4ForConditionalGeneration"],
    model_type "gemma4", the text config under "text_config" (model_type "gemma4_text"; `hub_config`: in
    hub_text_config's form, as google's releases), small "vision_config" and "audio_config"; tensors
    model.language_model.*, model.vision_tower.*, model.embed_vision.*, model.audio_tower.*, model.embed_audio.*
    (no lm_head.weight: tied), which a text-only reader must skip."""
    folder = Path(folder)
    gemma4_multimodal_model(model, audio=audio).save_pretrained(folder)
    byte_level_tokenizer(model.config.vocab_size).save_pretrained(folder)
    if hub_config:
        _rewrite_text_config(folder, True, model.config)
    return folder


# --- GGUF, as llama.cpp's converter writes it ---

def rope_freqs(config: Gemma4TextConfig) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: ggml's NeoX RoPE rotates the first n_rot dims' pairs only, while
    "proportional" RoPE rotates pairs (i, i + head_dim / 2) for i < the rotated count; so the full layers rotate
    the whole head with these frequency factors: 1 for the int(head_dim * partial_rotary_factor / 2) rotated
    frequencies, 1e30 (theta / 1e30: no rotation) for the rest."""
    head_dim, _ = attention_shape(config)
    n_rot = int(head_dim * config.rope_parameters[FULL]["partial_rotary_factor"] / 2)
    return np.array([1.0] * n_rot + [1e30] * (head_dim // 2 - n_rot), dtype=np.float32)


def gemma4_gguf_tensors(model: Gemma4ForCausalLM) -> dict[str, np.ndarray]:
    """The model's tensors as Gemma4Model names them (its state dict is what save_pretrained writes, buffers
    included), rope_freqs first as the converter writes its extra tensors first."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config.num_hidden_layers)
    rope = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    tensors = {rope: rope_freqs(config)}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = value.float().numpy()
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):
            tensors[f"blk.{bid}.ffn_gate_inp.scale"] = array
            continue
        if name.endswith("router.per_expert_scale"):
            tensors[f"blk.{bid}.ffn_down_exps.scale"] = array
            continue
        if name.endswith(("layer_scalar", ".experts.gate_up_proj", ".experts.down_proj")):
            name += ".weight"  # Gemma4Model.filter_tensors: parameters without a ".weight" get one
        key = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert key is not None, f"the gguf tensor map has no name for {name}"
        tensors[key] = array
    return tensors


def gemma4_gguf_metadata(model: Gemma4ForCausalLM) -> dict[str, Any]:
    """gguf_factory's keys (TextModel's and the tokenizer's) with Gemma3Model's and Gemma4Model's, as they come
    out of a hub-form config.json (hub_text_config), each later writer overwriting an earlier one's key."""
    arch = "gemma4"
    c = model.config
    hub = hub_text_config(c)
    head_dim_full, _ = attention_shape(c)
    head_dim, n_kv = attention_shape(c, SLIDING)
    swa = [t == SLIDING for t in c.layer_types]
    shim = SimpleNamespace(num_hidden_layers=c.num_hidden_layers, max_position_embeddings=c.max_position_embeddings,
                           hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_attention_heads=c.num_attention_heads, num_key_value_heads=n_kv,
                           head_dim=head_dim_full, rope_parameters=c.rope_parameters[FULL],
                           rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size)
    metadata = gguf_metadata(shim, arch)
    metadata["general.name"] = f"tiny-random-{arch}"
    # The byte-level vocabulary's GPT-2 splitting under the name llama.cpp knows it by for any architecture (it
    # refuses "gpt2"; the converter would have written Gemma 4's own "gemma4" model and no pre-tokenizer at all).
    metadata["tokenizer.ggml.pre"] = "default"
    del metadata[f"{arch}.vocab_size"]  # Gemma4Model never writes it (the token list's length is the vocabulary)
    keys = gguf.Keys
    metadata.update({
        keys.Rope.FREQ_BASE_SWA.format(arch=arch): float(c.rope_parameters[SLIDING]["rope_theta"]),
        keys.Attention.SLIDING_WINDOW.format(arch=arch): c.sliding_window,
        keys.Attention.SHARED_KV_LAYERS.format(arch=arch): c.num_kv_shared_layers,
        keys.LLM.EMBD_LENGTH_PER_LAYER_INP.format(arch=arch): c.hidden_size_per_layer_input or 0,
        keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch): swa,  # True: sliding
        keys.Attention.KEY_LENGTH_SWA.format(arch=arch): head_dim,
        keys.Attention.VALUE_LENGTH_SWA.format(arch=arch): head_dim,
        # the full layers' RoPE spans the whole head (rope_freqs stops the unrotated frequencies); the sliding
        # layers': head_dim * hparams.get("partial_rotary_factor", 1.0), a top-level key no Gemma 4 config has
        keys.Rope.DIMENSION_COUNT.format(arch=arch): head_dim_full,
        keys.Rope.DIMENSION_COUNT_SWA.format(arch=arch): head_dim,
    })
    if c.final_logit_softcapping:
        metadata[keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=arch)] = float(c.final_logit_softcapping)
    if c.enable_moe_block:  # TextModel's num_experts / top_k_experts; Gemma4Model's moe_intermediate_size
        metadata.update({keys.LLM.EXPERT_COUNT.format(arch=arch): c.num_experts,
                         keys.LLM.EXPERT_USED_COUNT.format(arch=arch): c.top_k_experts,
                         keys.LLM.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch): c.moe_intermediate_size})
    if c.use_double_wide_mlp:  # the shared layers' MLP twice as wide (the flag without sharing: all plain)
        first_shared = c.num_hidden_layers - c.num_kv_shared_layers
        metadata[keys.LLM.FEED_FORWARD_LENGTH.format(arch=arch)] = [
            c.intermediate_size * (1 if i < first_shared else 2) for i in range(c.num_hidden_layers)]
    if hub["num_global_key_value_heads"] is not None:
        metadata[keys.Attention.HEAD_COUNT_KV.format(arch=arch)] = [
            n_kv if s else hub["num_global_key_value_heads"] for s in swa]
    return metadata


def write_gemma4_gguf(model: Gemma4ForCausalLM, path: Path, quant: GGMLQuantizationType = F32) -> Path:
    """The model as llama.cpp's Gemma4Model writes it (arch "gemma4"). `quant`: the converter's --outtype (F32,
    F16, BF16, Q8_0): matrices in it, the rest F32 as the converter keeps them (1-D tensors: norms, rope_freqs,
    layer_output_scale, the router's scales; "_norm.weight"; the router ffn_gate_inp), a matrix whose rows do not
    fill whole blocks in F16 (Q8_0: blk.N.proj.weight, rows of hidden_size_per_layer_input = 16)."""
    return _write_gguf(Path(path), gemma4_gguf_metadata(model), gemma4_gguf_tensors(model), "gemma4", quant)
