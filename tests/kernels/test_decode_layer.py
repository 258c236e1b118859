"""One native call per decoder layer for decode tokens (kvlm/kernels/csrc/decode_layer.h) against the same layers run
op by op (the decoder with the native layer ops and products, kvlm.model.backend.NativeCpuBackend): the same arithmetic in the
same order, so the logits and the bytes written to the KV cache are equal bit for bit. Real files (SmolLM2's Q4_1,
Qwen2.5's Q5_0/Q8_0/Q4_K/Q6_K with Q/K/V biases, Gemma 3's QK-norm, sandwich norms, GeGLU and two KV pools) and a
random Gemma 3 whose sliding window the steps run past; every KV dtype; float32 and bfloat16 activations; ragged
sequences decoding together and a lone one; the build for this CPU and the plain C++ one. And Qwen3.5's Gated DeltaNet
layers as one call each (kvlm/kernels/csrc/delta_layer.h), their recurrent states compared too."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.gemma3_factory import WINDOW, gguf_of, random_gemma3
from helpers.models import decode_ok
from kvlm import Batch, Context, load_model
from kvlm.kernels import native_kernels
from kvlm.kernels.decode_layer import NativeDecodeLayer

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="the native kernels are not built here")

PROMPTS = [[1, 504, 3575, 282, 4649], [1, 314, 253, 1345, 28, 653, 1584], [1, 11164, 12816]]


def steps(model, kv_dtype: str, n_steps: int, prompts=PROMPTS) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prompts in one batch, then `n_steps` greedy steps of every sequence together, then two steps of the
    first alone: every step's logits, and the KV cache's planes afterwards."""
    ctx = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=len(prompts), kv_dtype=kv_dtype)
    tokens = [t for p in prompts for t in p]
    seq_ids = [s for s, p in enumerate(prompts) for _ in p]
    outputs = [i == len(p) - 1 for p in prompts for i in range(len(p))]
    decode_ok(ctx, Batch(tokens=tokens, seq_ids=seq_ids, logits=outputs))
    logits = [torch.stack([ctx.get_logits_ith(s) for s in range(len(prompts))])]
    positions = [len(p) for p in prompts]
    for _ in range(n_steps):
        following = [int(row.argmax()) % 900 + 50 for row in logits[-1]]
        decode_ok(ctx, Batch(tokens=following, pos=positions, seq_ids=list(range(len(prompts))),
                             logits=[True] * len(prompts)))
        positions = [p + 1 for p in positions]
        logits.append(torch.stack([ctx.get_logits_ith(s) for s in range(len(prompts))]))
    for _ in range(2):
        decode_ok(ctx, Batch(tokens=[int(logits[-1][0].argmax()) % 900 + 50], pos=[positions[0]], seq_ids=[0],
                             logits=[True]))
        positions[0] += 1
        logits.append(ctx.get_logits_ith(0).expand(len(prompts), -1))
    planes = [t.clone() for pool in ctx.memory.pools for plane in (pool.store.k, pool.store.v)
              for t in plane.stored() if t is not None]
    recurrent = getattr(ctx.memory, "recurrent", None)  # a hybrid memory's states, as committed
    if recurrent is not None:
        planes += [s.clone() for slot in range(recurrent.n_seq_max) for layer in recurrent.committed(slot) for s in layer]
    return torch.stack(logits), planes


def fused_and_op_by_op(model, kv_dtype: str, monkeypatch, n_steps: int = 4, prompts=PROMPTS):
    calls = []
    original = NativeDecodeLayer.__call__
    monkeypatch.setattr(NativeDecodeLayer, "__call__", lambda self, x, *args:
                        calls.append(x.shape[0]) or original(self, x, *args))
    fused = steps(model, kv_dtype, n_steps, prompts)
    decode_layers, model.decoder.decode_layers = model.decoder.decode_layers, None
    try:
        op_by_op = steps(model, kv_dtype, n_steps, prompts)
    finally:
        model.decoder.decode_layers = decode_layers
    return fused, op_by_op, calls


def assert_same(fused, op_by_op) -> None:
    (logits, planes), (expected_logits, expected_planes) = fused, op_by_op
    assert torch.equal(logits, expected_logits), f"logits differ by {(logits - expected_logits).abs().max():.3e}"
    assert all(torch.equal(a, b) for a, b in zip(planes, expected_planes)), "the KV cache or the states differ"


@pytest.fixture(scope="module")
def smollm2_defaults(smollm2_gguf_path):
    return load_model(str(smollm2_gguf_path), progress=False)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8_0"])
def test_smollm2_decodes_as_op_by_op(smollm2_defaults, kv_dtype, monkeypatch):
    fused, op_by_op, calls = fused_and_op_by_op(smollm2_defaults, kv_dtype, monkeypatch)
    assert_same(fused, op_by_op)
    n_layer = smollm2_defaults.config.n_layer
    # every decode step, and the short prompts too (runs of a sequence this short read their rows as decode tokens)
    assert calls == [sum(map(len, PROMPTS))] * n_layer + [3] * 4 * n_layer + [1] * 2 * n_layer


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
def test_bfloat16_activations_decode_as_op_by_op(smollm2_gguf_path, kv_dtype, monkeypatch):
    model = load_model(str(smollm2_gguf_path), "bfloat16", progress=False)
    fused, op_by_op, calls = fused_and_op_by_op(model, kv_dtype, monkeypatch, n_steps=2)
    assert_same(fused, op_by_op)
    assert calls


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_qwen_with_biases_and_mixed_formats_decodes_as_op_by_op(qwen_gguf_path, kv_dtype, monkeypatch):
    model = load_model(str(qwen_gguf_path), progress=False)
    fused, op_by_op, calls = fused_and_op_by_op(model, kv_dtype, monkeypatch, n_steps=3)
    assert_same(fused, op_by_op)
    assert len(calls) == 6 * model.config.n_layer  # the short prompts' batch and 5 decode steps


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
def test_gemma_with_qk_norm_sandwich_norms_and_two_pools_decodes_as_op_by_op(gemma_gguf_path, kv_dtype,
                                                                              monkeypatch):
    model = load_model(str(gemma_gguf_path), progress=False)
    fused, op_by_op, calls = fused_and_op_by_op(model, kv_dtype, monkeypatch, n_steps=3)
    assert_same(fused, op_by_op)
    assert len(calls) == 6 * model.config.n_layer  # the short prompts' batch and 5 decode steps


def test_decode_past_the_sliding_window_is_op_by_op(tmp_path, monkeypatch):
    """A random Gemma 3 requantized to Q8_0 (so its matrices are read natively) decodes well past its window: the
    sliding layers' cells are the window's, the full layers' all of them."""
    model = load_model(str(gguf_of(random_gemma3(), tmp_path)), "float32", quant="int8", progress=False)
    prompts = [[1, 5, 7, 9], [1, 30, 40, 50, 60, 70], [1, 99]]  # within its 1000 tokens
    fused, op_by_op, calls = fused_and_op_by_op(model, "f32", monkeypatch, n_steps=WINDOW + 4, prompts=prompts)
    assert_same(fused, op_by_op)
    assert len(calls) == (WINDOW + 7) * model.config.n_layer  # the short prompts' batch and every decode step


@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "qwen2moe"])
def test_layers_of_experts_run_their_attention_natively_as_op_by_op(tmp_path, monkeypatch, name):
    """Random mixtures of experts (Q8_0): the native call runs each layer's attention up to its experts' input
    (per-head QK-norm; OLMoE's over whole projections; Qwen2-MoE's biases), the experts run after it."""
    from gguf import GGMLQuantizationType
    from helpers.moe_factory import SPECS, random_moe, save_moe_folder, write_moe_gguf

    reference = random_moe(SPECS[name])
    path = write_moe_gguf(reference, SPECS[name], save_moe_folder(reference, tmp_path / "hf"), tmp_path / "m.gguf",
                          GGMLQuantizationType.Q8_0)
    model = load_model(str(path), progress=False)
    prompts = [[1, 5, 7, 9], [1, 30, 40, 50, 60, 70], [1, 99]]
    fused, op_by_op, calls = fused_and_op_by_op(model, "f16", monkeypatch, n_steps=3, prompts=prompts)
    assert_same(fused, op_by_op)
    assert len(calls) == 6 * model.config.n_layer  # the short prompts' batch and 5 decode steps


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_gated_deltanet_layers_decode_natively_as_op_by_op(tmp_path, monkeypatch, dtype, moe):
    """Random Qwen3.5 files (Q8_0): each Gated DeltaNet layer of a decode step as one native call (delta_layer.h),
    its states stepped in the memory's banks, and each gated attention layer as one (decode_layer.h); logits, KV
    cache and committed states equal to the layers run op by op.
    The MoE model's delta-rule layers stop at their experts' input, the experts run after."""
    from gguf import GGMLQuantizationType
    from helpers.qwen35_factory import random_qwen35, random_qwen35_moe, write_qwen35_gguf, write_qwen35moe_gguf

    from kvlm.core.family import GATED_DELTA
    from kvlm.kernels.delta_layer import NativeDeltaLayer

    reference = random_qwen35_moe() if moe else random_qwen35()
    write = write_qwen35moe_gguf if moe else write_qwen35_gguf
    model = load_model(str(write(reference, tmp_path / "q.gguf", GGMLQuantizationType.Q8_0)), dtype, progress=False)
    calls, original = [], NativeDeltaLayer.__call__
    monkeypatch.setattr(NativeDeltaLayer, "__call__", lambda self, x, states, n_tokens, normed=None:
                        calls.append(x.shape[0]) or original(self, x, states, n_tokens, normed))
    prompts = [[1, 5, 7, 9], [1, 30, 40, 50, 60, 70], [1, 99]]
    fused, op_by_op, attention_calls = fused_and_op_by_op(model, "f16", monkeypatch, n_steps=3, prompts=prompts)
    assert_same(fused, op_by_op)
    n_delta = model.config.layer_kinds.count(GATED_DELTA)
    assert n_delta and calls[-5 * n_delta:] == [3] * 3 * n_delta + [1] * 2 * n_delta  # every decode step
    # the gated attention layers too (output gate, RoPE over a quarter of each head)
    n_attention = model.config.n_layer - n_delta
    assert attention_calls[-5 * n_attention:] == [3] * 3 * n_attention + [1] * 2 * n_attention


def test_the_plain_cpp_build_decodes_as_op_by_op(smollm2_gguf_path):
    """The fused layer of a build without AVX2 (matrices read row by row in the file's layout), in a process of its
    own (the kernels are chosen once per process)."""
    script = f"""
import sys
sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]  # it, and helpers
import pytest, torch
from kvlm import load_model
from kvlm.kernels import native_kernels
import test_decode_layer as t
assert not native_kernels().tiles, native_kernels().isa
model = load_model({str(smollm2_gguf_path)!r}, progress=False)
monkeypatch = pytest.MonkeyPatch()
fused, op_by_op, calls = t.fused_and_op_by_op(model, "q8_0", monkeypatch, n_steps=2)
t.assert_same(fused, op_by_op)
assert calls
print("same")
"""
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "KVLM_NATIVE": "x86-64"},
                          capture_output=True, text=True)
    assert done.stdout.strip().endswith("same"), done.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["shared_kv", "k_eq_v", "moe"])
def test_gemma4_layers_decode_natively_as_op_by_op(tmp_path, monkeypatch, variant, dtype):
    """Random Gemma 4 files (Q8_0) decoding past their sliding window: each layer as one native call with its
    kind's head size and KV heads, unscaled scores, V through a weightless norm, then the per-layer input's term and
    the output scale; the last layers reading earlier layers' K/V ("shared_kv", with per-layer inputs and double-wide
    MLPs), or the full layers' V taken from K ("k_eq_v"). Layers with experts beside their MLP ("moe") run op by
    op."""
    from gguf import GGMLQuantizationType
    from helpers.gemma4_factory import random_gemma4, random_gemma4_moe, write_gemma4_gguf

    made = {"shared_kv": lambda: random_gemma4(hidden_size_per_layer_input=32),
            "k_eq_v": lambda: random_gemma4(attention_k_eq_v=True, num_kv_shared_layers=0,
                                            hidden_size_per_layer_input=0),
            "moe": random_gemma4_moe}[variant]()
    path = write_gemma4_gguf(made, tmp_path / "g.gguf", GGMLQuantizationType.Q8_0)
    # float32 activations over native blocks (requantized: "auto" reads float32 models densely)
    model = load_model(str(path), dtype, quant="int8" if dtype == "float32" else "auto", progress=False)
    prompts = [[1, 5, 7, 9], [1, 30, 40, 50, 60, 70], [1, 99]]
    for kv_dtype in ("f32", "q8_0"):
        fused, op_by_op, calls = fused_and_op_by_op(model, kv_dtype, monkeypatch, n_steps=10, prompts=prompts)
        assert_same(fused, op_by_op)
        # the short prompts' batch and every decode step
        assert len(calls) == (0 if variant == "moe" else 13 * model.config.n_layer)
