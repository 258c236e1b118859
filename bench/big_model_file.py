"""A GGUF of real size with no hub: Qwen2.5-7B's (or 14B's) shapes, or a mixture of experts' (OLMoE-1B-7B's,
Qwen3-30B-A3B's, gpt-oss-20b's), or Qwen3.5-0.8B's (linear attention), or Gemma 4 E2B's (per-layer inputs, shared
KV), random weights, quantized by llama.cpp to the mix people download (Q4_K_M; for gpt-oss, MXFP4_MOE).

No checkpoint of 3B+ parameters is reachable from this machine (shared/MODELS.md), but memory use, load time and decode
speed depend on the shapes and the quantization mix, not on the values. So this writes a file with exactly the
tensors llama.cpp's qwen2 architecture expects for Qwen2.5-7B (or 14B), filled with seeded random normals, and the
real Qwen2.5 tokenizer and chat template (copied from the Qwen2.5-Coder-0.5B GGUF kvlm fetches), then lets
llama.cpp's own quantizer turn it into the Q4_K_M mix people download. Good for memory, loading and speed; the
text it generates is noise.

    python -m bench.big_model_file --out ~/.cache/kvlm/bench/qwen2.5-7b-shaped-q4_k_m.gguf [--shape qwen2.5-14b]
    python -m bench.big_model_file --shape gpt-oss-20b --out ~/.cache/kvlm/bench/gpt-oss-20b-shaped-mxfp4.gguf

or `make_big_model(path)` from Python. The F16 intermediate (15 GB for the 7B, 30 GB for the 14B; 14 GB for
gpt-oss-20b, its experts already MXFP4) is written next to the output and deleted after quantization; memory stays
at a few hundred MB while writing it. The experts of the MoE shapes are written as random Q4_K blocks instead (the
F16 intermediate of a 30B would be 61 GB, and llama.cpp's Q4_K search takes ~300 ns a weight on one core here:
hours for 29B experts): llama.cpp's quantizer then keeps the experts its Q4_K_M mix leaves in Q4_K as they are and
requantizes the ones it gives more bits (some ffn_down_exps to Q6_K), so each tensor's type is still llama.cpp's
choice.

The gpt-oss-20b shape is the file llama.cpp's converter makes of openai/gpt-oss-20b, architecture "gpt-oss": biases
on all four attention projections, a sink logit per head (attn_sinks), a 128-position window (llama.cpp slides
every other layer), YaRN RoPE (factor 32 over 4096 positions), post_attention_norm as the pre-MLP norm's name, and
32 experts of 2880 (4 per token) with a biased router and biased products. OpenAI releases those experts in MXFP4
and the converter keeps them so; the experts here are written directly as random MXFP4 blocks, as the Q4_K ones
above (19B expert weights would be 38 GB of F16 intermediate), and llama.cpp's MXFP4_MOE mix keeps them and makes
every other matrix Q8_0 (routers, biases, sinks and norms stay F32), as in the gpt-oss files people download. Its
vocabulary is gpt-oss's 201088 (the head alone is about a quarter of the bytes a decoded token reads): the Qwen2.5
tokenizer's 151936 tokens padded with unused ones ([PAD151936] on, as Qwen's own file ends).

A finished file is renamed into place at the end, so an existing output is complete and is returned as is (a
cache). Needs the bench extra (llama-cpp-python). Takes minutes: for the 7B on 2 cores, about 3 to write the F16
file and 10 to quantize it (4.68 GB out, 339 tensors: Q4_K 169, Q6_K 29, F32 141); for gpt-oss-20b, under 3 and
1 (12.10 GB out, 459 tensors: MXFP4 72, Q8_0 98, F32 289).

The qwen3.5-0.8b shape is the text part of what llama.cpp's converter (Qwen3_5TextModel) makes of Qwen/Qwen3.5-0.8B,
architecture "qwen35": 24 layers, every 4th full attention (8 heads of 256 over 2 KV heads; attn_q holds each head's
query and output gate, QK-norm, RoPE over 64 of the 256 dimensions with MRoPE sections [11, 11, 10, 0] that text
positions make a plain RoPE), the 18 others Gated DeltaNet layers (16 key heads of 128, 16 value heads of 128, a
causal convolution of 4 kept F32, A = -exp(A_log) stored as ssm_a, a gated norm per value head), an MLP of 3584 on
every layer behind post_attention_norm, the head tied to the 248320-row embedding (no output.weight). Its norms are
stored as llama.cpp's converter writes them: multipliers near 1 (it adds 1 to Hugging Face's w; the gated norm is
stored as is, also near 1). Converters since the MTP support also append the multi-token-prediction block (block 24,
nextn_predict_layers 1) unless run with --no-mtp; plain decoding never runs it, and this file, like the first
conversions of the model, has none. The vocabulary is Qwen2.5's tokenizer padded to 248320 (Qwen3.5's own is not
reachable here): speed is the same, the text is noise either way. About 2 minutes to write and 1 to quantize (526.5 MB
out, 320 tensors: Q4_K 162, Q6_K 25 (the tied embedding, 10 of the 18 attn_qkv, half the ffn_down, 2 of the 6
attn_v), F32 133 (norms, ssm_a, ssm_dt.bias, ssm_conv1d)).

    python -m bench.big_model_file --shape qwen3.5-0.8b --out ~/.cache/kvlm/bench/qwen3.5-0.8b-shaped-q4_k_m.gguf

The gemma4-e2b shape is the text part of what llama.cpp's converter (Gemma4Model) makes of google/gemma-4-E2B-it,
architecture "gemma4": 35 layers, 4 sliding-window ones (window 512, 8 heads of 256 over 1 KV head, RoPE base 1e4)
before each full one (8 heads of 512 over 1, "proportional" RoPE turning a quarter of the frequencies, written as
rope_freqs.weight factors, base 1e6); the last 20 layers compute no K/V (no attn_k, attn_v, attn_k_norm: they read
layers 13's and 14's) and have MLPs twice as wide (12288 against 6144); QK-norms, norms before and after attention
and MLP (multipliers, as Gemma 4 stores them: not shifted), a scalar on each layer's output, GELU-tanh; per-layer
inputs: a 262144 x 8960 table (256 per layer), a projection of the embedding to it, a gate, projection and norm in
every layer; the head tied to the 262144-row embedding, logits softcapped at 30. The table is 2.35 B of the file's
4.63 B weights: it is written directly as random Q6_K blocks, the type llama.cpp's Q4_K_M mix gives it (a token
embedding of a tied model, as token_embd), so the F16 intermediate is 6.5 GB instead of 9.3. llama.cpp's dry run of
the mix: about 3.41 GB out, 541 tensors: Q4_K 251, Q6_K 26 (the two embeddings, 7 of the 15 attn_v, 17 of the 35
ffn_down), F16 1 (per_layer_model_proj, which llama.cpp never quantizes), F32 263 (norms, output scalars,
rope_freqs). The vocabulary is Qwen2.5's tokenizer padded to 262144, as for the other shapes.

    python -m bench.big_model_file --shape gemma4-e2b --out ~/.cache/kvlm/bench/gemma4-e2b-shaped-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from bench.llama_cpp_driver import import_llama_cpp
from kvlm.home import kvlm_home
from kvlm.loader.fetch import pull
from kvlm.startup import START_CPUS

TOKENIZER_SOURCE = "qwen2.5-coder-0.5b-instruct"  # same tokenizer and chat template as every Qwen2.5 model
SEED = 0
MATRIX_STD = 0.02  # the usual initializer range of Qwen2 configs
BIAS_STD = 0.01
CHUNK_VALUES = 32 * 1024 * 1024  # values drawn at once: 128 MB of float32 plus 64 MB of float16
Q4_K, Q6_K, MXFP4 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.MXFP4
# Q4_K super-blocks of 256 weights in 144 bytes: f16 d and dmin, 12 of scales, 128 of nibbles. d * scale * level -
# dmin * min, scales and mins uniform in 0..63, levels in 0..15: a spread of about MATRIX_STD
Q4_K_D = MATRIX_STD / 32 / 5
# MXFP4 blocks of 32 weights in 17 bytes: an E8M0 exponent e, then 16 of nibbles; a weight is KVALUES[nibble] *
# 2^(e - 128). Uniform nibbles' values spread by 5.85: e = 120 gives 0.023, about MATRIX_STD
MXFP4_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
MXFP4_E = 128 + round(math.log2(MATRIX_STD / float(MXFP4_KVALUES.std())))
# Q6_K super-blocks of 256 weights in 210 bytes: 128 of low nibbles, 64 of high bit pairs, 16 int8 scales, f16 d last;
# a weight is d * scale * (level - 32), levels 0..63: random bytes spread scales by 74 and levels by 18.5
Q6_K_D = MATRIX_STD / 74 / 18.5
# Where in each random block the scales that set its spread go, and their bytes (the rest of the block stays random)
BLOCK_SCALES = {Q4_K: (0, np.array([Q4_K_D, Q4_K_D], dtype=np.float16).view(np.uint8)),
                MXFP4: (0, np.array([MXFP4_E], dtype=np.uint8)),
                Q6_K: (208, np.array([Q6_K_D], dtype=np.float16).view(np.uint8))}
MIN_BITS_PER_WEIGHT = 2  # below every llama.cpp quantization mix: a smaller file at the output path is not a model


@dataclass(frozen=True)
class Mix:
    """What llama.cpp's quantizer makes of these architectures' tensors in one of its file types: the types that
    must and that may appear, and the experts' (a few MoE tensors get more bits in Q4_K_M)."""

    label: str  # in file names
    required: frozenset[str]
    allowed: frozenset[str]
    experts: frozenset[str]


MIXES = {
    # F16: Gemma 4's per_layer_model_proj, which llama.cpp never quantizes (the only matrix check lets stay F16)
    gguf.LlamaFileType.MOSTLY_Q4_K_M: Mix("q4_k_m", frozenset({"Q4_K"}),
                                          frozenset({"Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16", "F32"}),
                                          frozenset({"Q4_K", "Q5_K", "Q6_K", "Q8_0"})),
    # experts (3-D) MXFP4, every other matrix Q8_0 (embedding and head too), vectors and routers F32
    gguf.LlamaFileType.MOSTLY_MXFP4_MOE: Mix("mxfp4", frozenset({"MXFP4", "Q8_0", "F32"}),
                                             frozenset({"MXFP4", "Q8_0", "F32"}), frozenset({"MXFP4"})),
}


@dataclass(frozen=True)
class Shape:
    """A model's hyperparameters, as the GGUF's {arch}.* keys record them (Qwen2.5's by default)."""

    size_label: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int = 151936  # the tokenizer's, padded: llama.cpp wants one embedding row per token
    context_length: int = 32768
    rope_freq_base: float = 1e6
    rms_eps: float = 1e-6
    arch: str = "qwen2"
    family_name: str = "Qwen2.5"
    qkv_bias: bool = True
    qk_norm: str = ""  # "head": over each head (Qwen3); "whole": over each token's whole Q and K (OLMoE)
    key_length: int = 0  # head_dim when it is not n_embd / n_head
    n_expert: int = 0  # a mixture of experts: experts per layer (in place of the MLP), used per token, their width
    n_expert_used: int = 0
    n_ff_exp: int = 0
    experts_type: gguf.GGMLQuantizationType = Q4_K  # the random blocks the experts are written in
    expert_biases: bool = False  # gpt-oss: biases on the router and on every expert's products
    output_bias: bool = False  # gpt-oss: a bias on attn_output too
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head (attn_sinks.weight)
    ffn_norm: str = "ffn_norm"  # the pre-MLP norm's GGUF name (gpt-oss: post_attention_norm)
    sliding_window: int = 0  # attention.sliding_window (the architecture decides which layers slide)
    yarn_factor: float = 0.0  # rope.scaling: YaRN's factor over its original context length
    yarn_original_context: int = 0
    tied: bool = False  # no output.weight: llama.cpp (and kvlm) use the embedding as the head
    attention_output_gate: bool = False  # Qwen3.5: attn_q gives each head a query and a gate (twice the rows)
    rope_dims: int = 0  # rope.dimension_count when RoPE rotates part of each head
    rope_sections: tuple[int, ...] = ()  # rope.dimension_sections (MRoPE; text positions read the same in all)
    # Qwen3.5's Gated DeltaNet: every full_attention_interval-th layer attends, the others are linear attention with
    # ssm_groups key heads and ssm_heads value heads (of ssm_state and ssm_head_dim), a convolution of ssm_conv_kernel
    full_attention_interval: int = 0
    ssm_conv_kernel: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    # Gemma 4: sliding_per_full sliding layers (heads of key_length_swa, RoPE base rope_freq_base_swa) before each
    # full one (heads of key_length, its RoPE turning rotated_fraction of the frequencies); the last shared_kv_layers
    # compute no K/V (they read earlier layers') and, double_wide_mlp, have an MLP of 2 n_ff; every layer takes an
    # input of n_embd_per_layer per token from a second embedding table; logits softcapped at logit_softcap
    sliding_per_full: int = 0
    key_length_swa: int = 0
    rope_freq_base_swa: float = 0.0
    rotated_fraction: float = 0.0
    shared_kv_layers: int = 0
    double_wide_mlp: bool = False
    n_embd_per_layer: int = 0
    logit_softcap: float = 0.0
    ftype: int = gguf.LlamaFileType.MOSTLY_Q4_K_M  # llama.cpp's mix (a key of MIXES)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head  # llama.cpp's default when the file has no key_length

    def attends(self, layer: int) -> bool:
        """Whether the layer is attention (else Gated DeltaNet): llama.cpp's qwen35 rule."""
        return not self.full_attention_interval or (layer + 1) % self.full_attention_interval == 0

    def slides(self, layer: int) -> bool:
        """Whether the layer is a sliding-window one (Gemma 4's pattern; the other architectures' is llama.cpp's)."""
        return bool(self.sliding_per_full) and (layer + 1) % (self.sliding_per_full + 1) != 0

    def layer_head_dim(self, layer: int) -> int:
        return self.key_length_swa if self.slides(layer) else self.head_dim

    def has_kv(self, layer: int) -> bool:
        """Whether the layer computes its own K and V (else it reads an earlier layer's: no attn_k, attn_v)."""
        return layer < self.n_layer - self.shared_kv_layers

    def layer_n_ff(self, layer: int) -> int:
        return self.n_ff * (2 if self.double_wide_mlp and not self.has_kv(layer) else 1)


SHAPES = {
    "qwen2.5-7b": Shape("7B", n_layer=28, n_embd=3584, n_ff=18944, n_head=28, n_head_kv=4),
    "qwen2.5-14b": Shape("14B", n_layer=48, n_embd=5120, n_ff=13824, n_head=40, n_head_kv=8),
    # allenai/OLMoE-1B-7B-0924's config.json (its own vocabulary is 50304: this takes Qwen's tokenizer instead)
    "olmoe-1b-7b": Shape("1B-7B", n_layer=16, n_embd=2048, n_ff=1024, n_head=16, n_head_kv=16, context_length=4096,
                         rope_freq_base=10000.0, rms_eps=1e-5, arch="olmoe", family_name="OLMoE", qkv_bias=False,
                         qk_norm="whole", n_expert=64, n_expert_used=8, n_ff_exp=1024),
    # Qwen/Qwen3-30B-A3B's config.json
    "qwen3-30b-a3b": Shape("30B-A3B", n_layer=48, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4, context_length=40960,
                           arch="qwen3moe", family_name="Qwen3", qkv_bias=False, qk_norm="head", key_length=128,
                           n_expert=128, n_expert_used=8, n_ff_exp=768),
    # openai/gpt-oss-20b's config.json, as llama.cpp's converter writes it (feed_forward_length too is the experts')
    "gpt-oss-20b": Shape("20B", n_layer=24, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8, n_vocab=201088,
                         context_length=131072, rope_freq_base=150000.0, rms_eps=1e-5, arch="gpt-oss",
                         family_name="gpt-oss", key_length=64, n_expert=32, n_expert_used=4, n_ff_exp=2880,
                         experts_type=MXFP4, expert_biases=True, output_bias=True, attention_sinks=True,
                         ffn_norm="post_attention_norm", sliding_window=128, yarn_factor=32.0,
                         yarn_original_context=4096, ftype=gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
    # Qwen/Qwen3.5-0.8B's text_config as llama.cpp's converter (Qwen3_5TextModel) writes it. Sources (public copies):
    # zhils/Qwen3.5_0.8B_Deploy docs/implementation/qwen3_5_0_8b_architecture.md (made from the model's config.json:
    # 24 layers, hidden 1024, MLP 3584, 8 heads / 2 KV heads of 256, linear heads 16 K / 16 V of 128, conv 4,
    # rms eps 1e-6, 262144 positions, vocab 248320, tied, full_attention_interval 4, partial_rotary_factor 0.25,
    # rope_theta 1e7, mrope_interleaved), a test's mirror of that config.json (mrope_section [11, 11, 10]); llama.cpp's
    # converter (conversion/qwen.py: Qwen3NextModel.set_gguf_parameters writes ssm.conv_kernel, state_size = key head
    # dim, group_count = key heads, time_step_rank = value heads, inner_size = value heads x dim,
    # full_attention_interval, rope.dimension_count = head_dim x 0.25; modify_tensors: A_log -> -exp, dt_bias ->
    # ssm_dt.bias, conv1d squeezed, norms + 1 except linear_attn.norm; _Qwen35MRopeMixin: dimension_sections
    # [11, 11, 10, 0]; TextModel: key_length/value_length from head_dim, SSM_CONV1D and 1-D tensors kept F32).
    "qwen3.5-0.8b": Shape("0.8B", n_layer=24, n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2, n_vocab=248320,
                          context_length=262144, rope_freq_base=1e7, arch="qwen35", family_name="Qwen3.5",
                          qkv_bias=False, qk_norm="head", key_length=256, ffn_norm="post_attention_norm", tied=True,
                          attention_output_gate=True, rope_dims=64, rope_sections=(11, 11, 10, 0),
                          full_attention_interval=4, ssm_conv_kernel=4, ssm_state=128, ssm_groups=16, ssm_heads=16,
                          ssm_head_dim=128),
    # google/gemma-4-E2B-it's text_config (tests/models/test_gemma4.py's E2B_TEXT_CONFIG, from public copies of the
    # release's config.json) as llama.cpp's converter (conversion/gemma.py: Gemma4Model) writes it
    "gemma4-e2b": Shape("E2B", n_layer=35, n_embd=1536, n_ff=6144, n_head=8, n_head_kv=1, n_vocab=262144,
                        context_length=131072, arch="gemma4", family_name="Gemma-4", qkv_bias=False, qk_norm="head",
                        key_length=512, sliding_window=512, tied=True, sliding_per_full=4, key_length_swa=256,
                        rope_freq_base_swa=1e4, rotated_fraction=0.25, shared_kv_layers=20, double_wide_mlp=True,
                        n_embd_per_layer=256, logit_softcap=30.0),
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its numpy shape ([out, in] for matrices; gguf's writer reverses it into ggml's order),
    its dtype, and the normal distribution its values come from."""

    name: str
    shape: tuple[int, ...]
    dtype: type
    mean: float
    std: float
    blocks: gguf.GGMLQuantizationType | None = None  # written as random blocks of this type (see _blocks_to_file)
    uniform: tuple[float, float] | None = None  # values uniform in [low, high) instead (ssm_a: sane decays)
    values: tuple[float, ...] | None = None  # these values instead (rope_freqs: which frequencies turn)

    @property
    def nbytes(self) -> int:
        if self.blocks is not None:
            weights, nbytes = gguf.GGML_QUANT_SIZES[self.blocks]
            return int(np.prod(self.shape)) // weights * nbytes
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def matrix(name: str, rows: int, cols: int) -> TensorSpec:
    return TensorSpec(name, (rows, cols), np.float16, 0.0, MATRIX_STD)


def norm(name: str, size: int, value: float = 1.0) -> TensorSpec:
    return TensorSpec(name, (size,), np.float32, value, 0.0)  # RMSNorm weights start at one


def bias(name: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, shape, np.float32, 0.0, BIAS_STD)


def experts(name: str, n_expert: int, rows: int, cols: int, blocks: gguf.GGMLQuantizationType) -> TensorSpec:
    return TensorSpec(name, (n_expert, rows, cols), np.float32, 0.0, MATRIX_STD, blocks=blocks)


def gated_delta_specs(blk: str, shape: Shape) -> list[TensorSpec]:
    """A Gated DeltaNet layer's tensors as llama.cpp's converter writes them (qwen35): Q, K and V in one projection
    (attn_qkv), the output gate's (attn_gate), beta's and the decay's (ssm_beta, ssm_alpha), the depthwise
    convolution over Q, K and V (F32), A = -exp(A_log) (negative: decays exp(A softplus(.)) well inside (0, 1)), the
    time-step bias, the gated norm over one value head (a multiplier near 1) and the output projection."""
    d, v_dim = shape.n_embd, shape.ssm_heads * shape.ssm_head_dim
    conv_dim = 2 * shape.ssm_groups * shape.ssm_state + v_dim
    heads = shape.ssm_heads
    return [matrix(f"{blk}.attn_qkv.weight", conv_dim, d), matrix(f"{blk}.attn_gate.weight", v_dim, d),
            matrix(f"{blk}.ssm_beta.weight", heads, d), matrix(f"{blk}.ssm_alpha.weight", heads, d),
            # PyTorch's Conv1d init, U(+-1/sqrt(fan_in)) with fan_in the kernel: its std
            TensorSpec(f"{blk}.ssm_conv1d.weight", (conv_dim, shape.ssm_conv_kernel), np.float32, 0.0,
                       1 / math.sqrt(3 * shape.ssm_conv_kernel)),
            TensorSpec(f"{blk}.ssm_a", (heads,), np.float32, 0.0, 0.0, uniform=(-3.0, -0.5)),
            bias(f"{blk}.ssm_dt.bias", heads), norm(f"{blk}.ssm_norm.weight", shape.ssm_head_dim),
            matrix(f"{blk}.ssm_out.weight", d, v_dim)]


def tensor_specs(shape: Shape) -> list[TensorSpec]:
    """Every tensor of llama.cpp's architecture for the shape: qwen2's q/k/v with biases, or the QK-norms of
    qwen3moe and qwen35 (per head) and olmoe (whole projections), or gpt-oss's biases on all four projections and its
    sinks, or qwen35's Gated DeltaNet layers between its attention layers (whose attn_q carries a gate per head); an
    MLP, or a router and experts (gpt-oss's with biases); an output matrix of its own unless tied. Gemma 4's in
    gemma4_specs."""
    if shape.arch == "gemma4":
        return gemma4_specs(shape)
    d, q_rows, kv_rows = shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    norm_sizes = {"head": (shape.head_dim, shape.head_dim), "whole": (q_rows, kv_rows)}
    specs = [matrix("token_embd.weight", shape.n_vocab, d)]
    for i in range(shape.n_layer):
        blk = f"blk.{i}"
        specs += [norm(f"{blk}.attn_norm.weight", d)]
        if not shape.attends(i):
            specs += gated_delta_specs(blk, shape)
            specs += [norm(f"{blk}.{shape.ffn_norm}.weight", d), matrix(f"{blk}.ffn_gate.weight", shape.n_ff, d),
                      matrix(f"{blk}.ffn_up.weight", shape.n_ff, d), matrix(f"{blk}.ffn_down.weight", d, shape.n_ff)]
            continue
        q_out = q_rows * (2 if shape.attention_output_gate else 1)
        for part, rows in (("attn_q", q_out), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            specs += [matrix(f"{blk}.{part}.weight", rows, d)] + ([bias(f"{blk}.{part}.bias", rows)] if shape.qkv_bias
                                                                   else [])
        if shape.qk_norm:
            q_norm, k_norm = norm_sizes[shape.qk_norm]
            specs += [norm(f"{blk}.attn_q_norm.weight", q_norm), norm(f"{blk}.attn_k_norm.weight", k_norm)]
        specs += [matrix(f"{blk}.attn_output.weight", d, q_rows)]
        specs += [bias(f"{blk}.attn_output.bias", d)] if shape.output_bias else []
        specs += [bias(f"{blk}.attn_sinks.weight", shape.n_head)] if shape.attention_sinks else []  # logits near 0
        specs += [norm(f"{blk}.{shape.ffn_norm}.weight", d)]
        if shape.n_expert:
            width, n = shape.n_ff_exp, shape.n_expert
            specs += [TensorSpec(f"{blk}.ffn_gate_inp.weight", (n, d), np.float32, 0.0, MATRIX_STD)]
            specs += [bias(f"{blk}.ffn_gate_inp.bias", n)] if shape.expert_biases else []
            for part, rows, cols in (("gate", width, d), ("up", width, d), ("down", d, width)):
                specs += [experts(f"{blk}.ffn_{part}_exps.weight", n, rows, cols, shape.experts_type)]
                specs += [bias(f"{blk}.ffn_{part}_exps.bias", n, rows)] if shape.expert_biases else []
        else:
            specs += [matrix(f"{blk}.ffn_gate.weight", shape.n_ff, d), matrix(f"{blk}.ffn_up.weight", shape.n_ff, d),
                      matrix(f"{blk}.ffn_down.weight", d, shape.n_ff)]
    return specs + [norm("output_norm.weight", d)] + ([] if shape.tied else [matrix("output.weight", shape.n_vocab, d)])


def gemma4_specs(shape: Shape) -> list[TensorSpec]:
    """The tensors llama.cpp's converter (Gemma4Model) writes for a dense Gemma 4 with per-layer inputs: rope_freqs
    first (its extra tensor); per layer an output scalar, Q (and K and V unless the layer reads an earlier one's),
    QK-norms, norms after attention and the MLP as well as before them, a GeGLU MLP, the per-layer input's gate,
    projection and norm; the per-layer table, its projection from the embedding and its norm. The QK-norms are
    head_dim^-1/4, not 1: Gemma 4 does not scale its scores, and with unit q and k they would spread by
    sqrt(head_dim) (softmax an argmax); at head_dim^-1/4 they spread by 1. The per-layer table (262144 x 8960 for
    E2B) is written as random Q6_K blocks, the type llama.cpp's Q4_K_M mix gives it (a token embedding of a model
    whose head is tied to its embedding), as the MoE shapes' experts are written as Q4_K blocks."""
    d, per_layer = shape.n_embd, shape.n_embd_per_layer
    specs = [rope_freqs(shape), matrix("token_embd.weight", shape.n_vocab, d)]
    for i in range(shape.n_layer):
        blk, head_dim, n_ff = f"blk.{i}", shape.layer_head_dim(i), shape.layer_n_ff(i)
        q_rows, kv_rows, qk_norm = shape.n_head * head_dim, shape.n_head_kv * head_dim, head_dim ** -0.25
        specs += [norm(f"{blk}.layer_output_scale.weight", 1), matrix(f"{blk}.attn_q.weight", q_rows, d),
                  norm(f"{blk}.attn_q_norm.weight", head_dim, qk_norm)]
        if shape.has_kv(i):
            specs += [norm(f"{blk}.attn_k_norm.weight", head_dim, qk_norm), matrix(f"{blk}.attn_k.weight", kv_rows, d),
                      matrix(f"{blk}.attn_v.weight", kv_rows, d)]
        specs += [matrix(f"{blk}.attn_output.weight", d, q_rows), matrix(f"{blk}.ffn_gate.weight", n_ff, d),
                  matrix(f"{blk}.ffn_up.weight", n_ff, d), matrix(f"{blk}.ffn_down.weight", d, n_ff)]
        specs += [norm(f"{blk}.{part}.weight", d) for part in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                               "post_ffw_norm")]
        specs += [matrix(f"{blk}.inp_gate.weight", per_layer, d), matrix(f"{blk}.proj.weight", d, per_layer),
                  norm(f"{blk}.post_norm.weight", d)]
    table = TensorSpec("per_layer_token_embd.weight", (shape.n_vocab, shape.n_layer * per_layer), np.float32, 0.0,
                       MATRIX_STD, blocks=Q6_K)
    return specs + [norm("output_norm.weight", d), table,
                    matrix("per_layer_model_proj.weight", shape.n_layer * per_layer, d),
                    norm("per_layer_proj_norm.weight", per_layer)]


def rope_freqs(shape: Shape) -> TensorSpec:
    """Gemma 4's full layers' "proportional" RoPE as llama.cpp's converter writes it: factors over the whole head's
    frequencies, 1 for the rotated_fraction that turn, 1e30 (frequency / 1e30: still) for the others."""
    half = shape.head_dim // 2
    turning = int(shape.head_dim * shape.rotated_fraction / 2)
    return TensorSpec("rope_freqs.weight", (half,), np.float32, 0.0, 0.0,
                      values=(1.0,) * turning + (1e30,) * (half - turning))


def parameter_count(shape: Shape) -> int:
    return sum(int(np.prod(spec.shape)) for spec in tensor_specs(shape))


# --- the F16 intermediate, streamed ---------------------------------------------------------------------------------

class RandomTensor:
    """What GGUFWriter.write_tensor_data needs of a numpy array (the nbytes it checks against the tensor's info, and
    tofile), with the values drawn and written in chunks of rows: no tensor is ever whole in memory (the embedding
    alone is 1.1 GB in F16). The scratch buffers are shared by all tensors, so their pages are touched once."""

    def __init__(self, spec: TensorSpec, rng: np.random.Generator, scratch: dict[type, np.ndarray]) -> None:
        self.spec, self.rng, self.scratch = spec, rng, scratch
        self.nbytes = spec.nbytes

    def tofile(self, fout) -> None:
        spec = self.spec
        if spec.blocks is not None:
            self._blocks_to_file(fout)
            return
        if spec.values is not None:
            np.array(spec.values, dtype=spec.dtype).tofile(fout)
            return
        cols = spec.shape[-1]
        rows = spec.shape[0] if len(spec.shape) == 2 else 1
        step = max(1, CHUNK_VALUES // cols)
        for start in range(0, rows, step):
            n = min(step, rows - start) * cols
            values = self.scratch[np.float32][:n]
            if spec.uniform is not None:
                values[:] = self.rng.uniform(*spec.uniform, size=n)
            else:
                self.rng.standard_normal(dtype=np.float32, out=values)
                values *= spec.std
                values += spec.mean
            if spec.dtype is not np.float32:
                np.copyto(self.scratch[spec.dtype][:n], values)
                values = self.scratch[spec.dtype][:n]
            values.tofile(fout)

    def _blocks_to_file(self, fout) -> None:
        """Random blocks with BLOCK_SCALES' bytes in place (Q4_K: the same d and dmin in every super-block,
        random scales, mins and levels; Q6_K: the same d, random scales and levels; MXFP4: the same exponent in
        every block, random nibbles), in chunks of CHUNK_VALUES weights."""
        weights, nbytes = gguf.GGML_QUANT_SIZES[self.spec.blocks]
        offset, scales = BLOCK_SCALES[self.spec.blocks]
        n_blocks = self.spec.nbytes // nbytes
        per_chunk = CHUNK_VALUES // weights
        for start in range(0, n_blocks, per_chunk):
            n = min(per_chunk, n_blocks - start)
            blocks = self.rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
            blocks[:, offset:offset + scales.size] = scales
            blocks.tofile(fout)


def add_tokenizer(writer: gguf.GGUFWriter, n_vocab: int) -> None:
    """The real Qwen2.5 tokenizer: every tokenizer.* key of the small checkpoint, chat template included, its
    token list padded to n_vocab (llama.cpp wants a token per embedding row) with unused tokens named as the ones
    Qwen's file already ends with ("[PAD151935]")."""
    reader = gguf.GGUFReader(pull(TOKENIZER_SOURCE))
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_vocab < n_tokens:
        raise ValueError(f"the tokenizer has {n_tokens} tokens, the embedding only {n_vocab} rows")
    padding = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(n_tokens, n_vocab)],
               "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (n_vocab - n_tokens)}
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(name, value + padding[name] if name in padding else value, kind, sub_type=sub_type)


def add_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_type("model")
    writer.add_name(f"{shape.family_name}-{shape.size_label}-shaped random (kvlm bench)")
    writer.add_size_label(shape.size_label)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.n_layer)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length([shape.layer_n_ff(i) for i in range(shape.n_layer)] if shape.double_wide_mlp
                                   else shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.key_length:
        writer.add_key_length(shape.key_length)
        writer.add_value_length(shape.key_length)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff_exp)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.yarn_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn_factor)
        writer.add_rope_scaling_orig_ctx_len(shape.yarn_original_context)
    if shape.rope_dims:
        writer.add_rope_dimension_count(shape.rope_dims)
    if shape.rope_sections:
        writer.add_rope_dimension_sections(list(shape.rope_sections))
    if shape.full_attention_interval:  # the keys of llama.cpp's Qwen3NextModel.set_gguf_parameters
        writer.add_ssm_conv_kernel(shape.ssm_conv_kernel)
        writer.add_ssm_state_size(shape.ssm_state)
        writer.add_ssm_group_count(shape.ssm_groups)
        writer.add_ssm_time_step_rank(shape.ssm_heads)
        writer.add_ssm_inner_size(shape.ssm_heads * shape.ssm_head_dim)
        writer.add_full_attention_interval(shape.full_attention_interval)
    if shape.sliding_per_full:
        add_gemma4_metadata(writer, shape)
    add_tokenizer(writer, shape.n_vocab)


def add_gemma4_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """The keys llama.cpp's Gemma4Model.set_gguf_parameters adds: the sliding pattern, the sliding layers' head size
    and RoPE base, RoPE over each kind's whole head (rope_freqs stops the full layers' still frequencies), the shared
    layers, the per-layer input width, the softcap."""
    writer.add_sliding_window_pattern([shape.slides(i) for i in range(shape.n_layer)])
    writer.add_key_length_swa(shape.key_length_swa)
    writer.add_value_length_swa(shape.key_length_swa)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_dimension_count_swa(shape.key_length_swa)
    writer.add_rope_freq_base_swa(shape.rope_freq_base_swa)
    writer.add_shared_kv_layers(shape.shared_kv_layers)
    writer.add_embedding_length_per_layer_input(shape.n_embd_per_layer)
    writer.add_final_logit_softcapping(shape.logit_softcap)


def write_f16(path: Path, shape: Shape, progress: bool) -> None:
    """All tensor infos first (the header needs them), then header, metadata and infos, then the data one tensor
    at a time."""
    specs = tensor_specs(shape)
    writer = gguf.GGUFWriter(path, shape.arch)
    add_metadata(writer, shape)
    for spec in specs:
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(spec.dtype), spec.nbytes, raw_dtype=spec.blocks)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    scratch = {np.float32: np.empty(CHUNK_VALUES, np.float32), np.float16: np.empty(CHUNK_VALUES, np.float16)}
    with tqdm(total=sum(spec.nbytes for spec in specs), unit="B", unit_scale=True, desc="F16 random weights",
              disable=not progress) as bar:
        for spec in specs:
            writer.write_tensor_data(RandomTensor(spec, rng, scratch))  # in add_tensor_info's order
            bar.update(spec.nbytes)
    writer.close()


# --- quantization and checks ------------------------------------------------------------------------------------

def quantize(src: Path, dst: Path, ftype: int, progress: bool) -> None:
    """llama.cpp's own quantizer (what llama-quantize runs), so the type chosen per tensor is llama.cpp's mix. Its
    log (a line per tensor) is the progress report; without progress, only its errors are printed."""
    import llama_cpp  # the bench extra: only needed here

    if not progress:
        import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the experts' blocks, where the mix gives them another type
    params.nthread = len(START_CPUS)
    os.sched_setaffinity(0, START_CPUS)  # torch's OpenMP pinned this thread to one core: llama.cpp's would inherit it
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to file type {ftype}")


def check(path: Path, shape: Shape, ftype: int) -> Counter:
    """The file llama.cpp wrote: architecture, layers, tensors and file type as asked; every matrix quantized
    (routers and biases stay F32), in the types of the ftype's mix. Returns the count of tensors per type."""
    reader = gguf.GGUFReader(path)
    fields = reader.fields
    found = {
        "architecture": fields["general.architecture"].contents(),
        "block count": fields[f"{shape.arch}.block_count"].contents(),
        "tensor count": len(reader.tensors),
        "file type": fields["general.file_type"].contents(),
    }
    wanted = {"architecture": shape.arch, "block count": shape.n_layer, "tensor count": len(tensor_specs(shape)),
              "file type": ftype}
    if found != wanted:
        raise RuntimeError(f"{path}: {found}, expected {wanted}")
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    left_float = [t.name for t in reader.tensors if len(t.shape) >= 2 and t.tensor_type.name in ("F16", "F32")
                  and not t.name.endswith(("ffn_gate_inp.weight", ".bias", "ssm_conv1d.weight",
                                           "per_layer_model_proj.weight"))]
    # llama.cpp keeps routers, biases and convolutions F32, and Gemma 4's per-layer input projection as it is (F16)
    if left_float:
        raise RuntimeError(f"{path}: matrices left unquantized: {left_float[:5]}")
    mix = MIXES.get(ftype)
    if mix is not None and not (mix.required <= set(types) <= mix.allowed):
        raise RuntimeError(f"{path}: tensor types {dict(types)}, not the {mix.label} mix {sorted(mix.allowed)}")
    experts = {t.tensor_type.name for t in reader.tensors if t.name.endswith("_exps.weight")}
    if mix is not None and not experts <= mix.experts:
        raise RuntimeError(f"{path}: experts in {sorted(experts)}, not the {mix.label} mix's {sorted(mix.experts)}")
    return types


def is_cached(path: Path, shape: Shape) -> bool:
    """Only finished files are renamed to `path`; the size check turns away anything else found there."""
    return path.is_file() and path.stat().st_size * 8 >= parameter_count(shape) * MIN_BITS_PER_WEIGHT


def default_path(shape: str) -> Path:
    """Where the bench keeps the file of `shape` in its default mix: $KVLM_HOME/bench/{shape}-shaped-{mix}.gguf."""
    return kvlm_home() / "bench" / f"{shape}-shaped-{MIXES[SHAPES[shape].ftype].label}.gguf"


def make_big_model(out_path: Path, *, shape: str = "qwen2.5-7b", ftype: int | None = None,
                   progress: bool = True) -> Path:
    """Write (or find already written) a GGUF with the shapes of `shape` (a key of SHAPES), random weights and the
    Qwen2.5 tokenizer, quantized by llama.cpp to `ftype` (a llama_ftype; 15 = Q4_K_M, 38 = MXFP4_MOE; by default
    the shape's). Returns out_path."""
    out_path = Path(out_path).expanduser()
    dims = SHAPES[shape]
    ftype = dims.ftype if ftype is None else ftype
    if is_cached(out_path, dims):
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    f16 = out_path.with_name(out_path.name + ".f16.tmp")
    partial = out_path.with_name(out_path.name + ".tmp")
    try:
        started = time.perf_counter()
        write_f16(f16, dims, progress)
        written = time.perf_counter()
        if progress:
            print(f"F16 intermediate: {f16.stat().st_size / 1e9:.2f} GB in {written - started:.0f} s; quantizing",
                  flush=True)
        quantize(f16, partial, ftype, progress)
        if progress:
            print(f"quantized in {time.perf_counter() - written:.0f} s", flush=True)
        types = check(partial, dims, ftype)
        if progress:
            print(f"tensor types: {dict(types.most_common())}", flush=True)
        partial.rename(out_path)
    finally:
        f16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return out_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write (kept as a cache)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    args = parser.parse_args()
    path = make_big_model(args.out, shape=args.shape)
    print(f"{path}: {path.stat().st_size:,} bytes ({path.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
