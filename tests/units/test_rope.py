"""RoPE frequencies, attention factors and cos/sin against transformers; the config.json and GGUF readers."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers.family_factory import llama3_rope_factors
from kvlm.core.errors import UnsupportedModelError
from kvlm.core.rope import apply_rope
from kvlm.core.rope import KINDS, Rope, RopeScaling, hf_rotary_dims, rope_from_gguf, rope_from_hf_config

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, Qwen3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

# name: (config class, head_dim, max_position_embeddings, rope_parameters as transformers 5 writes them)
CASES = {
    "default-64": (LlamaConfig, 64, 2048, {"rope_type": "default", "rope_theta": 10000.0}),
    "default-128": (Qwen3Config, 128, 40960, {"rope_type": "default", "rope_theta": 1000000.0}),
    "linear-2": (LlamaConfig, 64, 4096, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "linear-4.5": (Qwen3Config, 128, 8192, {"rope_type": "linear", "factor": 4.5, "rope_theta": 500000.0}),
    "llama3.1": (LlamaConfig, 128, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                            "rope_theta": 500000.0}),
    "llama3.2": (LlamaConfig, 64, 131072, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                           "rope_theta": 500000.0}),
    "llama3-odd": (LlamaConfig, 64, 16384, {"rope_type": "llama3", "factor": 3.0, "low_freq_factor": 2.0,
                                            "high_freq_factor": 8.0, "original_max_position_embeddings": 1024,
                                            "rope_theta": 10000.0}),
    "yarn-qwen": (Qwen3Config, 128, 131072, {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768, "rope_theta": 1000000.0}),
    "yarn-64": (LlamaConfig, 64, 8192, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                                        "rope_theta": 10000.0}),
    "yarn-attention-factor": (LlamaConfig, 64, 8192, {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8,
                                                      "original_max_position_embeddings": 2048,
                                                      "rope_theta": 10000.0}),
    "yarn-mscale": (LlamaConfig, 64, 163840, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                              "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}),
    "yarn-no-truncate": (Qwen3Config, 128, 131072, {"rope_type": "yarn", "factor": 32.0, "truncate": False,
                                                    "beta_fast": 16.0, "beta_slow": 2.0,
                                                    "original_max_position_embeddings": 4096,
                                                    "rope_theta": 150000.0}),
    "yarn-derived-factor": (LlamaConfig, 64, 16384, {"rope_type": "yarn", "factor": None,
                                                     "original_max_position_embeddings": 4096,
                                                     "rope_theta": 10000.0}),
    "dynamic-64": (LlamaConfig, 64, 2048, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "dynamic-128": (Qwen3Config, 128, 1024, {"rope_type": "dynamic", "factor": 3.5, "rope_theta": 1000000.0}),
    # Phi-4-mini's shape of LongRoPE: its factor derived from max_position_embeddings / the original
    "longrope": (LlamaConfig, 64, 131072, {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                                           "short_factor": [1.0 + 0.02 * i for i in range(32)],
                                           "long_factor": [1.0 + 1.5 * i for i in range(32)],
                                           "rope_theta": 10000.0}),
    "longrope-attention-factor": (Qwen3Config, 128, 8192, {"rope_type": "longrope", "attention_factor": 1.3,
                                                           "original_max_position_embeddings": 2048,
                                                           "short_factor": [1.1] * 64,
                                                           "long_factor": [2.0 + 0.25 * i for i in range(64)],
                                                           "rope_theta": 250000.0}),
}


def raw_config(name: str, old_spelling: bool = False) -> dict:
    """A config.json as a dict: transformers 5's rope_parameters, or rope_theta + rope_scaling."""
    _, head_dim, max_positions, params = CASES[name]
    raw = {"hidden_size": head_dim * 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
           "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 32, "max_position_embeddings": max_positions}
    params = copy.deepcopy(params)
    if not old_spelling:
        return {**raw, "rope_parameters": params}
    theta, kind = params.pop("rope_theta"), params.pop("rope_type")
    scaling = None if kind == "default" else {"rope_type" if kind == "llama3" else "type": kind, **params}
    return {**raw, "rope_theta": theta, "rope_scaling": scaling}


def hf_config(name: str, old_spelling: bool = False):
    return CASES[name][0].from_dict(raw_config(name, old_spelling))


def hf_init(config) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config)


def hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding on one forward (a fresh module: dynamic keeps state across calls)."""
    x = torch.zeros(1, len(positions), config.head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    return cos[0], sin[0]


def rope_of(name: str, n_ctx: int | None = None) -> Rope:
    """kvlm's RoPE for a context of n_ctx positions (LongRoPE's factors depend on it)."""
    return Rope(rope_from_hf_config(raw_config(name)).for_context(n_ctx), CASES[name][1])


def close(actual, expected, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# --- frequencies, attention factor, cos/sin ---

@pytest.mark.parametrize("name", CASES)
def test_inv_freq_and_attention_factor_match_transformers(name):
    rope = rope_of(name)
    inv_freq, attention_factor = hf_init(hf_config(name))
    close(rope.inv_freq, inv_freq, atol=0)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_cases_cover_every_kind():
    assert {params["rope_type"] for *_, params in CASES.values()} == set(KINDS)


@pytest.mark.parametrize("name", CASES)
def test_cos_sin_match_transformers_rotary_embedding(name):
    rope = rope_of(name)
    config = hf_config(name)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 2047, 2048, 5000, 30000])
    rope = rope_of(name, n_ctx=int(positions.max()) + 1)  # transformers' LongRoPE: the factors of this length
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert cos.shape == sin.shape == (len(positions), 1, rope.head_dim)
    expected_cos, expected_sin = hf_cos_sin(config, positions)
    close(cos[:, 0], expected_cos)
    close(sin[:, 0], expected_sin)


@pytest.mark.parametrize("name", ["yarn-qwen", "yarn-attention-factor", "yarn-mscale"])
def test_yarn_scales_cos_and_sin_by_the_attention_factor(name):
    rope = rope_of(name)
    assert rope.attention_factor != 1.0
    cos, sin = rope.cos_sin(torch.tensor([0]), torch.float32)
    close(cos, torch.full_like(cos, rope.attention_factor))
    close(sin, torch.zeros_like(sin))


def test_yarn_default_attention_factor_is_0_1_ln_factor_plus_1():
    assert rope_of("yarn-64").attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rope_of("yarn-derived-factor").scaling.factor == 4.0  # max_position_embeddings / original


@pytest.mark.parametrize("name", ["longrope", "longrope-attention-factor"])
def test_longrope_factors_by_context_length(name):
    """The short factors up to the original context, the long ones past it, as transformers computes each set."""
    original = CASES[name][3]["original_max_position_embeddings"]
    for n_ctx, seq_len in ((None, None), (original, None), (original + 1, original + 1)):
        rope = rope_of(name, n_ctx)
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config(name), seq_len=seq_len)
        close(rope.inv_freq, inv_freq, atol=0)
        assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12) and attention_factor > 1.0
    assert not torch.equal(rope_of(name, original + 1).inv_freq, rope_of(name, original).inv_freq)


def test_longrope_factors_checked():
    with pytest.raises(ValueError, match="as many long factors"):
        RopeScaling(kind="longrope", original_max_position_embeddings=16, short_factor=(1.0,) * 4,
                    long_factor=(1.0,) * 3)
    with pytest.raises(ValueError, match="short_factor must be positive"):
        RopeScaling(kind="longrope", original_max_position_embeddings=16, short_factor=(), long_factor=())
    scaling = RopeScaling(kind="longrope", original_max_position_embeddings=16, short_factor=(1.0,) * 4,
                          long_factor=(2.0,) * 4)
    with pytest.raises(ValueError, match="short_factor has 4 values, expected head_dim / 2 = 8"):
        Rope(scaling, 16)


@pytest.mark.parametrize("name", ["dynamic-64", "dynamic-128"])
@pytest.mark.parametrize("last", [0, 500, "original - 1", "original", "2 x original", "5 x original"])
def test_dynamic_cos_sin_below_and_above_the_original_length(name, last):
    rope = rope_of(name)
    original = rope.scaling.original_max_position_embeddings
    last = {"original - 1": original - 1, "original": original, "2 x original": 2 * original,
            "5 x original": 5 * original + 3}.get(last, last)
    positions = torch.tensor(sorted({0, 1, last // 2, last}))
    cos, sin = rope.cos_sin(positions, torch.float32)
    expected_cos, expected_sin = hf_cos_sin(hf_config(name), positions)
    close(cos[:, 0], expected_cos)
    close(sin[:, 0], expected_sin)
    grown = last + 1 > original
    assert grown == (not torch.equal(rope.inv_freq_at(last + 1), rope.inv_freq))
    if grown:
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config(name), seq_len=torch.tensor(last + 1))
        close(rope.inv_freq_at(last + 1), inv_freq, atol=0)


def test_cos_sin_dtype_and_empty_positions():
    rope = rope_of("dynamic-64")
    cos, sin = rope.cos_sin(torch.tensor([3, 4]), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    cos, _ = rope.cos_sin(torch.tensor([], dtype=torch.int64), torch.float32)
    assert cos.shape == (0, 1, 64)


@pytest.mark.parametrize("name", ["default-64", "linear-4.5", "llama3.1", "llama3.2", "yarn-qwen", "yarn-mscale",
                                  "yarn-attention-factor"])
def test_shift_composes_with_cos_sin(name):
    """RoPE(p + d) = R(d) RoPE(p): rotating cached K by the delta gives K written at the new position."""
    rope = rope_of(name)
    x = torch.rand(6, 3, rope.head_dim, generator=torch.Generator().manual_seed(0)) * 2 - 1
    for positions, deltas, atol in (
        ([0, 5, 17, 30, 2, 40], [3, -5, 20, -25, 7, -40], 1e-5),
        # float32 angles near 4000 rad are rounded by up to 2.4e-4 rad (transformers computes them so too)
        ([0, 5, 17, 300, 1500, 4000], [3, -5, 100, -250, 7, -3999], 4000 * 2**-24 * 3 * 3),
    ):
        positions, deltas = torch.tensor(positions), torch.tensor(deltas)
        cos, sin = rope.shift_cos_sin(deltas)
        assert cos.dtype == sin.dtype == torch.float32
        shifted = apply_rope(apply_rope(x, *rope.cos_sin(positions, torch.float32)), cos, sin)
        fresh = apply_rope(x, *rope.cos_sin(positions + deltas, torch.float32))
        close(shifted, fresh, rtol=0, atol=atol)


# --- config.json ---

@pytest.mark.parametrize("name", CASES)
def test_both_config_spellings_read_the_same(name):
    new = rope_from_hf_config(raw_config(name))
    assert rope_from_hf_config(raw_config(name, old_spelling=True)) == new
    assert new.kind == CASES[name][3]["rope_type"]


def test_config_details():
    assert rope_from_hf_config({"rope_theta": 5e5}) == RopeScaling(theta=5e5)
    assert rope_from_hf_config({}) == RopeScaling()
    assert rope_from_hf_config({"rope_scaling": None, "rope_theta": 1e6}) == RopeScaling(theta=1e6)
    assert rope_from_hf_config({"rope_scaling": {"type": "default"}}).kind == "default"
    # transformers: the dict's rope_theta wins over the top-level one
    assert rope_from_hf_config({"rope_theta": 1.0e4, "rope_parameters": {"rope_theta": 2.0e4}}).theta == 2.0e4
    # dynamic's original length is max_position_embeddings, as in transformers
    dynamic = rope_from_hf_config({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2}})
    assert dynamic.original_max_position_embeddings == 4096
    # llama3/yarn fall back to max_position_embeddings
    llama3 = rope_from_hf_config({"max_position_embeddings": 8192, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}})
    assert llama3.original_max_position_embeddings == 8192


def test_top_level_original_max_position_embeddings_wins_as_in_transformers():
    raw = raw_config("yarn-64")
    raw["original_max_position_embeddings"] = 1024
    ours = rope_from_hf_config(raw)
    assert ours.original_max_position_embeddings == 1024
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](LlamaConfig.from_dict(copy.deepcopy(raw)))
    close(Rope(ours, 64).inv_freq, inv_freq, atol=0)


@pytest.mark.parametrize("raw, error, words", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2}, "max_position_embeddings": 8}, ValueError,
     ["'longrope'", "short_factor"]),
    ({"rope_scaling": {"rope_type": "su", "factor": 2}}, UnsupportedModelError, ["'su'", "dynamic, longrope"]),
    ({"rope_parameters": {"rope_type": "mrope"}}, UnsupportedModelError, ["'mrope'", "default, linear"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     UnsupportedModelError, ["full_attention, sliding_attention"]),
    ({"rope_scaling": {"type": "linear"}}, ValueError, ["'linear'", "factor"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "max_position_embeddings": 8},
     ValueError, ["high_freq_factor"]),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ValueError, ["max_position_embeddings"]),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, ValueError, ["factor", "0"]),
])
def test_bad_configs(raw, error, words):
    with pytest.raises(error) as caught:
        rope_from_hf_config(raw)
    assert all(word in str(caught.value) for word in words), str(caught.value)


@pytest.mark.parametrize("raw, dims", [({}, 0), ({"partial_rotary_factor": 1.0}, 0), ({"partial_rotary_factor": 0.25}, 64),
                                       ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5},
                                         "partial_rotary_factor": 0.25}, 128)])
def test_partial_rotary_factor_gives_the_rotated_dimensions(raw, dims):
    """transformers rotates int(head_dim x factor) dimensions, the dict's factor over the top-level one."""
    assert hf_rotary_dims(raw, 256) == dims
    rope_from_hf_config(raw)  # the frequencies themselves are the same kind's


@pytest.mark.parametrize("factor", [0, 1.5, "half"])
def test_a_bad_partial_rotary_factor_is_refused(factor):
    with pytest.raises(ValueError, match=f"partial_rotary_factor must be a number in \\(0, 1\\], got {factor!r}"):
        hf_rotary_dims({"partial_rotary_factor": factor}, 128)


def test_partial_rope_rotates_the_first_dimensions_as_transformers_does():
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb
    torch.manual_seed(0)
    x = torch.randn(5, 3, 32)  # [tokens, heads, head_dim]
    rope = Rope(RopeScaling(theta=10000.0), 8)
    cos, sin = rope.cos_sin(torch.arange(10, 15), torch.float32)
    heads_first = x.transpose(0, 1)[None]  # [batch, heads, tokens, head_dim]
    theirs, _ = apply_rotary_pos_emb(heads_first, heads_first, cos[None, :, 0], sin[None, :, 0])
    ours = apply_rope(x, cos, sin)
    assert (ours - theirs[0].transpose(0, 1)).abs().max() <= 1e-6
    assert torch.equal(ours[..., 8:], x[..., 8:])


# --- GGUF ---

@pytest.mark.parametrize("name", ["llama3.1", "llama3.2"])
def test_gguf_llama3_rope_freqs_give_transformers_llama3_frequencies(name):
    _, head_dim, max_positions, params = CASES[name]
    metadata = {"llama.rope.freq_base": params["rope_theta"], "llama.context_length": max_positions}
    scaling = rope_from_gguf(metadata, "llama", llama3_rope_factors(params, head_dim).tolist())
    assert scaling.kind == "default" and len(scaling.freq_factors) == head_dim // 2
    rope = Rope(scaling, head_dim)
    inv_freq, _ = hf_init(hf_config(name))
    close(rope.inv_freq, inv_freq)
    positions = torch.tensor([0, 9, 4000, 100000])
    for ours, theirs in zip(rope.cos_sin(positions, torch.float32), hf_cos_sin(hf_config(name), positions)):
        close(ours[:, 0], theirs, rtol=1e-5, atol=2e-5)  # angles up to 1e5 rad: float32 rounding of the factors


def gguf_as_converted(name: str, arch: str = "qwen3") -> dict:
    """The {arch}.rope.* keys convert_hf_to_gguf.py writes for a config (TextModel.set_gguf_parameters)."""
    _, _, max_positions, params = CASES[name]
    metadata = {f"{arch}.context_length": max_positions, f"{arch}.rope.freq_base": params["rope_theta"]}
    kind, factor = params["rope_type"], params.get("factor")
    if kind == "linear":
        metadata |= {f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": factor}
    elif kind == "yarn":
        metadata |= {f"{arch}.rope.scaling.type": "yarn", f"{arch}.rope.scaling.factor": factor,
                     f"{arch}.rope.scaling.original_context_length": params["original_max_position_embeddings"]}
        for hf_key, gguf_key in (("attention_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                                 ("beta_slow", "yarn_beta_slow")):
            if hf_key in params:
                metadata[f"{arch}.rope.scaling.{gguf_key}"] = params[hf_key]
    return metadata


@pytest.mark.parametrize("name", ["default-64", "default-128", "linear-2", "linear-4.5", "yarn-qwen", "yarn-64",
                                  "yarn-attention-factor"])
def test_gguf_metadata_gives_transformers_frequencies(name):
    rope = Rope(rope_from_gguf(gguf_as_converted(name), "qwen3", None), CASES[name][1])
    inv_freq, attention_factor = hf_init(hf_config(name))
    close(rope.inv_freq, inv_freq, atol=0)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-7)


def test_gguf_details():
    assert rope_from_gguf({}, "llama", None) == RopeScaling()
    assert rope_from_gguf({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, "llama", None) \
        == RopeScaling()
    # llama.cpp's default type is linear: a factor alone scales
    assert rope_from_gguf({"llama.rope.scaling.factor": 2.0}, "llama", None) == RopeScaling(kind="linear", factor=2.0)
    assert rope_from_gguf({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, "llama", None) \
        == RopeScaling()
    # yarn's original length falls back to the context length, as llama.cpp's n_ctx_orig_yarn does
    yarn = rope_from_gguf({"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                           "qwen2.context_length": 32768}, "qwen2", None)
    assert yarn.original_max_position_embeddings == 32768 and yarn.beta_fast == 32 and yarn.beta_slow == 1


def test_gguf_yarn_log_multiplier_and_attn_factor_as_llama_cpp():
    base = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 40.0,
            "qwen2.rope.scaling.original_context_length": 4096}
    # llama.cpp: get_mscale(factor, 1) / get_mscale(factor, log_mul)
    logged = Rope(rope_from_gguf({**base, "qwen2.rope.scaling.yarn_log_multiplier": 0.5}, "qwen2", None), 64)
    assert logged.attention_factor == pytest.approx((0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1))
    # llama.cpp multiplies the whole magnitude by rope.scaling.attn_factor
    scaled = Rope(rope_from_gguf({**base, "qwen2.rope.scaling.attn_factor": 0.5}, "qwen2", None), 64)
    assert scaled.attention_factor == pytest.approx(0.5 * (0.1 * math.log(40) + 1))
    assert torch.equal(scaled.inv_freq, logged.inv_freq)


@pytest.mark.parametrize("metadata, words", [
    ({"llama.rope.scaling.type": "longrope"}, ["'longrope'", "none, linear, yarn"]),
    ({"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 2.0}, ["'dynamic'", "none, linear, yarn"]),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0, "llama.context_length": 64,
      "llama.rope.scaling.yarn_ext_factor": 0.5}, ["yarn_ext_factor=0.5"]),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
      "llama.rope.scaling.attn_factor": 0.5}, ["attn_factor=0.5"]),
])
def test_bad_gguf_metadata(metadata, words):
    with pytest.raises(UnsupportedModelError) as caught:
        rope_from_gguf(metadata, "llama", None)
    assert all(word in str(caught.value) for word in words), str(caught.value)


# --- validation ---

@pytest.mark.parametrize("kwargs, error, words", [
    ({"kind": "mrope"}, UnsupportedModelError, ["'mrope'", "default, linear, llama3, yarn, dynamic, longrope"]),
    ({"kind": "longrope", "original_max_position_embeddings": 8, "short_factor": (1.0, float("inf")),
      "long_factor": (1.0, 2.0)}, ValueError, ["RopeScaling.short_factor", "inf"]),
    ({"kind": "linear", "factor": 0}, ValueError, ["RopeScaling.factor", "0"]),
    ({"kind": "linear", "factor": -2.0}, ValueError, ["RopeScaling.factor", "-2.0"]),
    ({"factor": float("nan")}, ValueError, ["RopeScaling.factor"]),
    ({"theta": 0.0}, ValueError, ["RopeScaling.theta"]),
    ({"kind": "llama3", "factor": 8.0}, ValueError, ["original_max_position_embeddings", "'llama3'"]),
    ({"kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, ValueError,
     ["original_max_position_embeddings"]),
    ({"kind": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 4.0},
     ValueError, ["high_freq_factor", "low_freq_factor"]),
    ({"kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 0}, ValueError,
     ["RopeScaling.beta_fast"]),
    ({"kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "attention_factor": -1.0}, ValueError,
     ["RopeScaling.attention_factor"]),
    ({"freq_factors": (1.0, 0.0)}, ValueError, ["freq_factors"]),
    ({"truncate": "yes"}, ValueError, ["truncate"]),
])
def test_bad_rope_scaling(kwargs, error, words):
    with pytest.raises(error) as caught:
        RopeScaling(**kwargs)
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_bad_head_dims():
    with pytest.raises(ValueError, match="head_dim"):
        Rope(RopeScaling(), 63)
    with pytest.raises(ValueError, match="freq_factors has 3 values, expected head_dim / 2 = 32"):
        Rope(RopeScaling(freq_factors=[1.0, 2.0, 3.0]), 64)


def test_rope_scaling_is_hashable_and_freq_factors_a_tuple():
    scaling = RopeScaling(freq_factors=[1, 2.5])
    assert scaling.freq_factors == (1.0, 2.5)
    assert hash(scaling) == hash(RopeScaling(freq_factors=(1.0, 2.5)))
