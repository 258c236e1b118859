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
from kvlm.loader.load import load_model, load_summary
from kvlm.model.cpu import CpuFeatures, detect
from kvlm.runtime.generate import GenerationSettings, generate
from kvlm.kernels import native_kernels
from kvlm.kernels.quantize import quantize_q4_0
from kvlm.model.linear import QuantizedLinear
from kvlm.model.settings import FROM_FILE, resolve_settings

AVX512_BF16 = CpuFeatures("test CPU", "AVX512", frozenset({"avx512_bw", "avx512_vl", "avx512_dq", "avx512_bf16"}))
AVX512_NO_BF16 = CpuFeatures("test CPU", "AVX512", frozenset({"avx512_bw", "avx512_vl", "avx512_dq"}))
AMX = CpuFeatures("test CPU", "AVX512", frozenset({"avx512_bw", "avx512_vl", "avx512_dq", "amx_bf16"}))
AVX2_ONLY = CpuFeatures("test CPU", "AVX2", frozenset({"avx2", "fma3"}))
# Kernels limited to AVX2 on whatever CPU runs the tests: torch's dispatch and oneDNN's ISA both capped.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.parametrize("cpu, dtype", [
    (AVX512_BF16, "bfloat16"), (AMX, "bfloat16"), (AVX512_NO_BF16, "float32"), (AVX2_ONLY, "float32"),
])
def test_auto_picks_bfloat16_only_with_native_bf16_and_keeps_the_files_blocks(cpu, dtype):
    settings = resolve_settings(cpu=cpu, kernels=True)
    assert (settings.dtype, settings.quant) == (dtype, FROM_FILE)
    assert "test CPU" in settings.reason
    without_kernels = resolve_settings(cpu=cpu, kernels=False)
    assert (without_kernels.dtype, without_kernels.quant) == (dtype, None)
    assert "native kernels are unavailable" in without_kernels.reason


def test_explicit_settings_win_and_float32_is_the_reference():
    assert resolve_settings("float32", cpu=AVX512_BF16, kernels=True).quant is None
    assert resolve_settings("bfloat16", cpu=AVX2_ONLY, kernels=True).quant == FROM_FILE
    assert resolve_settings("bfloat16", None, cpu=AVX2_ONLY, kernels=True).quant is None
    assert resolve_settings("float32", "int4", kernels=True).quant == "int4"  # the kernels take float32 too



def test_every_mode_but_the_reference_one_is_batch_invariant():
    """`batch_invariant` asks nothing more of the fast modes, which are invariant by construction; the float32
    reference mode (transformers' own products) is invariant only when asked; compiled graphs never are."""
    for cpu in (AVX512_BF16, AVX2_ONLY):
        fast = resolve_settings(cpu=cpu, kernels=True)
        assert fast.batch_invariant and not fast.reference
        assert resolve_settings(batch_invariant=True, cpu=cpu, kernels=True) == fast
        assert resolve_settings(quant=None, cpu=cpu, kernels=True).batch_invariant  # dense, not the reference
        assert not resolve_settings(cpu=cpu, kernels=True, compile=True).batch_invariant
    reference = resolve_settings("float32", cpu=AVX512_BF16, kernels=True)
    assert reference.reference and not reference.batch_invariant and reference.quant is None
    assert resolve_settings("float32", batch_invariant=True, kernels=True).batch_invariant
    assert resolve_settings("float32", "int8", kernels=True).batch_invariant  # native products: not the reference


@pytest.mark.parametrize("settings, message", [
    ({"dtype": "float16"}, "dtype must be one of auto, float32, bfloat16, got 'float16'"),
    ({"quant": "int3"}, "quant must be one of auto, None, int8, int4, got 'int3'"),
    ({"quant": "int8", "kernels": False}, "quant 'int8' needs kvlm's native kernels"),
])
def test_bad_settings_are_refused_naming_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings(**settings)


@pytest.mark.parametrize("types, storage", [
    (["Q4_1"], FROM_FILE), (["Q4_0", "Q4_K"], FROM_FILE), (["Q4_K", "Q5_0", "Q6_K"], FROM_FILE), (["Q8_0"], FROM_FILE),
    (["MXFP4"], FROM_FILE), (["Q4_K", "F16"], None), (["bfloat16"], None), (["BF16"], None), (["IQ4_XS"], FROM_FILE),
])
def test_a_matrix_keeps_its_files_blocks_where_the_kernels_read_every_part(types, storage):
    assert resolve_settings("bfloat16", kernels=True).matrix_storage(types) == storage


def test_the_files_own_quantization_is_kept(smollm2_gguf_path, qwen_gguf_path):
    """SmolLM2 stores its layers in Q4_1 and its (tied) head in Q8_0; Qwen2.5 mixes Q4_K with Q5_0..Q8_0."""
    settings = resolve_settings("bfloat16", kernels=True)
    _, smol_types = load_summary(str(smollm2_gguf_path))
    assert {smol_types["blk.0.ffn_up.weight"], smol_types["token_embd.weight"]} == {"Q4_1", "Q8_0"}
    _, qwen_types = load_summary(str(qwen_gguf_path))
    down = {t for name, t in qwen_types.items() if name.endswith("ffn_down.weight")}
    assert down == {"Q4_K", "Q6_K"} and settings.matrix_storage(sorted(down)) == FROM_FILE


def test_smollm2_at_the_fast_settings_describes_its_kernels(smollm2_gguf_path):
    model = load_model(str(smollm2_gguf_path), "bfloat16")
    description = model.decoder.describe()
    assert "bfloat16 activations" in description
    kept = "120 Q4_1" in description and "1 Q8_0" in description  # 30 layers x 4 stacked matrices, the head
    assert kept if native_kernels() is not None else "121 dense packed" in description


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
import json, logging, kvlm
logging.basicConfig(level=logging.INFO)
from kvlm.model.settings import resolve_settings
from kvlm.loader.load import load_model
from kvlm.runtime.generate import GenerationSettings, generate
auto = resolve_settings()
model = load_model({path!r}, "bfloat16")  # asked for explicitly: must still work, just slower
ids = model.tokenizer.encode("The capital of France is")
print(json.dumps({{"dtype": auto.dtype, "quant": auto.quant, "reason": auto.reason,
                   "describe": model.decoder.describe(),
                   "tokens": generate(model, ids, GenerationSettings(max_tokens=4, ignore_eos=True)).token_ids}}))
"""


def run_fallback(path, env: dict) -> tuple[dict, str]:
    script = FALLBACK_SCRIPT.format(path=str(path))
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_without_fast_instructions_the_defaults_fall_back_to_float32(smollm2_gguf_path):
    result, _ = run_fallback(smollm2_gguf_path, AVX2_ENV)
    assert result["dtype"] == "float32" and "AVX2" in result["reason"]
    assert len(result["tokens"]) == 4


def test_without_a_compiler_the_weights_are_dense_and_it_still_talks(smollm2_gguf_path, tmp_path):
    """No native kernels (no C++ compiler, nothing built before): one log line says so, matrices are dense."""
    env = {"KVLM_HOME": str(tmp_path), "PATH": str(tmp_path), "CXX": ""}
    result, log = run_fallback(smollm2_gguf_path, env)
    assert result["quant"] is None and "dense" in result["describe"]
    assert log.count("native kernels unavailable") == 1 and "no C++ compiler" in log
    assert len(result["tokens"]) == 4


def test_this_machine_is_described():
    cpu = detect()
    assert cpu.kernel_level in cpu.describe()


@pytest.mark.skipif(native_kernels() is None, reason="no native kernels here: matrices are dense")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_products_are_native_at_every_row_count(dtype):
    """No dense copy and no dequantized slices, whatever the activations: every row count goes through the native
    kernels, which give a row the same bits alone or among any others (so a token's logits do not depend on its
    batch)."""
    torch.manual_seed(0)
    blocks = native_kernels().interleave(quantize_q4_0(torch.randn(96, 64)))
    linear = QuantizedLinear([blocks], dtype, native_kernels())
    many = torch.randn(300, 64, dtype=dtype)
    together = linear(many)
    assert torch.equal(together, linear.native(many))
    for rows in (1, 7, 8, 9, 48, 49, 64):
        assert torch.equal(linear(many[:rows]), together[:rows]), rows
    assert torch.equal(linear(many[-1:]), together[-1:])


@pytest.mark.skipif(native_kernels() is None, reason="requantizing needs the native kernels")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_requantized_smollm2_starts_like_float32(smollm2_gguf_path, smollm2, quant):
    """--quant int8/int4: every layer matrix requantized to Q8_0/Q4_1 (the head to Q8_0 at least)."""
    quantized = load_model(str(smollm2_gguf_path), "bfloat16", quant=quant)
    decoder = quantized.decoder
    layer_formats = {part.qtype.name for m in decoder.matrices()[1:] for part in m.parts}
    assert layer_formats == {"Q8_0" if quant == "int8" else "Q4_1"} and len(decoder.matrices()) == 121
    assert [part.qtype.name for part in decoder.output.parts] == ["Q8_0"]
    settings = GenerationSettings(max_tokens=4, ignore_eos=True)
    for prompt in ("The capital of France is", "def add(a, b):\n    return", "Water boils at"):
        ids = smollm2.tokenizer.encode(prompt)
        assert generate(quantized, ids, settings).token_ids[:2] == generate(smollm2, ids, settings).token_ids[:2]
