"""The fast defaults: chosen from this CPU's features at run time, each matrix as precise as its file stores it,
a clean fallback to float32 where the fast instructions are missing, and a quality guard against float32."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvlm import Batch, Context, DecodeStatus
from kvlm.load import load_model, load_summary
from kvlm.model.cpu import CpuFeatures, detect, onednn_packs
from kvlm.model.linear import RowAdaptiveLinear, make_linear
from kvlm.model.settings import FROM_FILE, resolve_settings

AVX512_BF16 = CpuFeatures("test CPU", "AVX512", frozenset({"avx512_bw", "avx512_vl", "avx512_dq", "avx512_bf16"}))
AVX512_NO_BF16 = CpuFeatures("test CPU", "AVX512", frozenset({"avx512_bw", "avx512_vl", "avx512_dq"}))
AMX = CpuFeatures("test CPU", "AVX512", frozenset({"avx512_bw", "avx512_vl", "avx512_dq", "amx_bf16"}))
AVX2_ONLY = CpuFeatures("test CPU", "AVX2", frozenset({"avx2", "fma3"}))
# Kernels limited to AVX2 on whatever CPU runs the tests: torch's dispatch and oneDNN's ISA both capped.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.parametrize("cpu, dtype, quant", [
    (AVX512_BF16, "bfloat16", FROM_FILE),
    (AMX, "bfloat16", FROM_FILE),
    (AVX512_NO_BF16, "float32", None),
    (AVX2_ONLY, "float32", None),
])
def test_auto_picks_bfloat16_only_with_native_bf16(cpu, dtype, quant):
    settings = resolve_settings(cpu=cpu)
    assert (settings.dtype, settings.quant) == (dtype, quant)
    assert "test CPU" in settings.reason


def test_explicit_settings_win_and_float32_is_the_reference():
    assert resolve_settings("float32", cpu=AVX512_BF16).quant is None
    assert resolve_settings(quant="int4", cpu=AVX2_ONLY).dtype == "bfloat16"  # the int kernels need it
    assert resolve_settings("bfloat16", None, cpu=AVX2_ONLY).quant is None
    invariant = resolve_settings(batch_invariant=True, cpu=AVX512_BF16)
    assert (invariant.dtype, invariant.quant) == ("float32", None)


@pytest.mark.parametrize("settings, message", [
    ({"dtype": "float16"}, "dtype must be one of auto, float32, bfloat16, got 'float16'"),
    ({"quant": "int3"}, "quant must be one of auto, None, int8, int4, got 'int3'"),
    ({"dtype": "float32", "quant": "int8"}, "quant 'int8' needs dtype bfloat16"),
    ({"dtype": "bfloat16", "batch_invariant": True}, "batch_invariant needs dense float32 weights"),
])
def test_bad_settings_are_refused_naming_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings(**settings)


@pytest.mark.parametrize("types, kernel", [
    (["Q4_1"], "int4"), (["Q4_0", "Q4_K"], "int4"), (["Q4_K", "Q5_0"], "int8"), (["Q6_K"], "int8"),
    (["Q8_0"], "int8"), (["Q4_K", "F16"], None), (["float"], None), (["BF16"], None),
])
def test_each_matrix_keeps_the_precision_of_its_most_precise_part(types, kernel):
    assert resolve_settings("bfloat16").matrix_quant(types) == kernel


def test_the_files_own_quantization_is_kept(smollm2_gguf_path, qwen_gguf_path):
    """SmolLM2 stores its layers in Q4_1 and its (tied) head in Q8_0; Qwen2.5 mixes Q4_K with Q5_0..Q8_0."""
    settings = resolve_settings("bfloat16")
    _, smol_types = load_summary(str(smollm2_gguf_path))
    assert settings.matrix_quant([smol_types["blk.0.ffn_up.weight"]]) == "int4"
    assert settings.matrix_quant([smol_types["token_embd.weight"]]) == "int8"
    _, qwen_types = load_summary(str(qwen_gguf_path))
    kernels = {settings.matrix_quant([t]) for name, t in qwen_types.items() if name.endswith("ffn_down.weight")}
    assert kernels <= {"int4", "int8"} and len(kernels) == 2


@pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="oneDNN cannot pack bf16 on this CPU: no copy is made")
def test_a_quantized_matrix_uses_its_bf16_copy_for_many_rows():
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    adaptive = make_linear(weight, torch.bfloat16, "int4", dense_copy=True)
    assert isinstance(adaptive, RowAdaptiveLinear)
    quantized, dense = adaptive.quantized, adaptive.dense
    few = torch.randn(RowAdaptiveLinear.MAX_QUANTIZED_ROWS, 64, dtype=torch.bfloat16)
    many = torch.randn(RowAdaptiveLinear.MAX_QUANTIZED_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(adaptive(few), quantized(few))
    assert torch.equal(adaptive(many), dense(many))
    # The copy holds the quantized weights themselves: the two differ only by rounding.
    torch.testing.assert_close(quantized(many).float(), dense(many).float(), atol=0.05, rtol=0.02)


def test_smollm2_at_the_fast_settings_describes_its_kernels(smollm2_gguf_path):
    model = load_model(str(smollm2_gguf_path), "bfloat16")
    description = model.decoder.describe()
    assert "bfloat16 activations" in description
    assert "120 int4" in description and "1 int8" in description  # 30 layers x 4 stacked matrices, the head


TEXT = (
    "The river begins as a thin stream of melted snow high in the mountains, where the air is cold and the ground "
    "stays frozen for most of the year. In early summer the snow on the northern slopes softens, and water gathers "
    "in small pools between the rocks before it finds a path downhill. Shepherds who bring their flocks to the high "
    "meadows know every bend of this young river, because it decides where the animals can drink and where the "
    "grass will grow thick. Further down the valley the stream is joined by dozens of others, and by the time it "
    "reaches the first village it is wide enough to turn a mill wheel. For centuries the villagers ground their "
    "grain here, paid the miller in flour, and argued about who had the right to divert water into the fields."
)


def all_logits(model, ids):
    ctx = Context(model, n_ctx=len(ids), n_seq_max=1, kv_dtype="f32")
    assert ctx.decode(Batch(tokens=ids, seq_ids=[0] * len(ids), logits=[True] * len(ids))) == DecodeStatus.OK
    return torch.stack([ctx.get_logits_ith(i) for i in range(len(ids))])


def test_the_bf16_quantized_path_keeps_float32s_choices(smollm2_gguf_path, smollm2):
    """The quality guard of the fast path, on any CPU. Its rounding moves logits by ~0.1-0.2, so it may flip
    near-ties (bench/quality.py measures >= 95% agreement over 10,200 tokens); where float32 leads by a whole
    logit the choice must be the same, and over a short text at least 90% overall."""
    ids = smollm2.tokenizer.encode(TEXT)
    fast, reference = all_logits(load_model(str(smollm2_gguf_path), "bfloat16"), ids), all_logits(smollm2, ids)
    same = fast.argmax(-1) == reference.argmax(-1)
    top2 = reference.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] >= 1.0
    assert same[clear].all(), f"{int((~same[clear]).sum())} of {int(clear.sum())} clear choices changed"
    assert same.float().mean().item() >= 0.9, f"top-1 agreement with float32 is {same.float().mean().item():.3f}"


FALLBACK_SCRIPT = """
import json, kvlm
from kvlm.model.settings import resolve_settings
from kvlm.load import load_model
from kvlm.generate import GenerationSettings, generate
auto = resolve_settings()
model = load_model({path!r}, "bfloat16")  # asked for explicitly: must still work, just slower
ids = model.tokenizer.encode("The capital of France is")
print(json.dumps({{"dtype": auto.dtype, "quant": auto.quant, "reason": auto.reason,
                   "tokens": generate(model, ids, GenerationSettings(max_tokens=4, ignore_eos=True)).token_ids}}))
"""


def test_without_fast_instructions_the_defaults_fall_back_to_float32(smollm2_gguf_path, smollm2):
    env = {**os.environ, **AVX2_ENV}
    script = FALLBACK_SCRIPT.format(path=str(smollm2_gguf_path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["dtype"], result["quant"]) == ("float32", None)
    assert "AVX2" in result["reason"]
    assert len(result["tokens"]) == 4


def test_this_machine_is_described():
    cpu = detect()
    assert cpu.kernel_level in cpu.describe()
