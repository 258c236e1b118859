"""The memory plan (issue 22): what a model will take is known from its file's header before any weight is read; a
model or context that does not fit is refused with each part named and what would fit; an unspecified n_ctx is the
largest that fits; the plan matches what the loaded decoder holds."""
from __future__ import annotations

import pytest
import torch

from helpers.gguf_factory import llama_config, random_llama, save_hf_folder
from kvlm.engine.llm import LLM
from kvlm.kernels import native_kernels
from kvlm.loader import memory_plan
from kvlm.loader.load import load_model
from kvlm.loader.memory_plan import MemoryPlanError, MemoryRequest, parse_size
from kvlm.loader.tensors import GGUFTensors
from kvlm.model.linear import linear_kind
from kvlm.model.settings import resolve_settings

MiB = 1 << 20


def limited(monkeypatch, limit: int, in_use: int = 100 * MiB) -> None:
    """This process may use `limit` bytes (as if its cgroup said so), `in_use` of which it already holds."""
    monkeypatch.setattr(memory_plan, "memory_limit", lambda: (limit, "cgroup limit"))
    monkeypatch.setattr(memory_plan, "resident_bytes", lambda: in_use)


def never_read(monkeypatch) -> None:
    monkeypatch.setattr(GGUFTensors, "read", lambda *args: pytest.fail("a weight was read"))


def test_a_model_that_does_not_fit_is_refused_before_any_weight_is_read(qwen_gguf_path, monkeypatch):
    limited(monkeypatch, 1024 * MiB)
    never_read(monkeypatch)
    with pytest.raises(MemoryPlanError) as refused:
        load_model(str(qwen_gguf_path), memory=MemoryRequest(n_ctx=32768, n_seq_max=2))
    message = str(refused.value)
    # The KV cache is bf16 or f16 (bfloat16 or float32 activations, which this CPU decides): 2 x 24 layers x 32768
    # cells x 128 values x 2 bytes.
    kv = f"384 MiB (n_ctx 32768, {'bf16' if resolve_settings().dtype == 'bfloat16' else 'f16'}"
    for part in ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf does not fit in memory", "weights 463 MiB",
                 f"KV cache {kv}, 2 sequences)", "compute buffers", "cgroup limit 1024 MiB",
                 "What would fit: --n-ctx", "with --kv-dtype q8_0"):
        assert part in message, f"{part!r} not in {message!r}"


def test_when_the_weights_alone_do_not_fit_the_advice_says_so(qwen_gguf_path, monkeypatch):
    limited(monkeypatch, 512 * MiB)
    never_read(monkeypatch)
    with pytest.raises(MemoryPlanError, match="The weights and buffers alone need .* more quantized file"):
        load_model(str(qwen_gguf_path))


def test_an_explicit_budget_caps_the_plan(qwen_gguf_path, monkeypatch):
    never_read(monkeypatch)
    with pytest.raises(MemoryPlanError, match="but the memory budget is 700 MiB"):
        load_model(str(qwen_gguf_path), memory=MemoryRequest(n_ctx=32768), memory_budget=700 * MiB)
    with pytest.raises(ValueError, match="memory_budget must be a positive number of bytes, got -1"):
        load_model(str(qwen_gguf_path), memory_budget=-1)


def test_n_ctx_not_given_is_the_largest_that_fits(qwen_gguf_path, smollm2_gguf_path, monkeypatch):
    plenty = load_model(str(smollm2_gguf_path), memory=MemoryRequest())
    assert plenty.plan.n_ctx == plenty.config.n_ctx_train == 8192
    limited(monkeypatch, 1300 * MiB)
    model = load_model(str(qwen_gguf_path), memory=MemoryRequest(n_seq_max=2))
    assert 256 <= model.plan.n_ctx < model.config.n_ctx_train and model.plan.n_ctx % 256 == 0
    assert model.plan.total <= 1300 * MiB * 0.95 - 100 * MiB


def test_one_step_more_context_would_not_fit(qwen_gguf_path, monkeypatch):
    limited(monkeypatch, 1300 * MiB)
    model = load_model(str(qwen_gguf_path), memory=MemoryRequest(n_seq_max=2), memory_budget=None)
    with pytest.raises(MemoryPlanError, match="does not fit in memory"):
        load_model(str(qwen_gguf_path), memory=MemoryRequest(n_ctx=model.plan.n_ctx + 256, n_seq_max=2))


@pytest.mark.skipif(native_kernels() is None, reason="without the native kernels, weights are dense by design")
def test_the_weights_are_the_files_size(smollm2_gguf_path, qwen_gguf_path):
    """The default mode multiplies every quantized matrix in its file's blocks, with no dense copy, so the weights
    take what the file's tensors take (plus the float32 norms)."""
    for path in (smollm2_gguf_path, qwen_gguf_path):
        model = load_model(str(path), memory=MemoryRequest(n_ctx=1024))
        assert "copy" not in model.decoder.describe()
        assert model.plan.weights == pytest.approx(path.stat().st_size, rel=0.03), path.name


@pytest.mark.skipif(native_kernels() is None, reason="without the native kernels, weights are dense by design")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_folders_matrices_are_held_as_stored(tmp_path, dtype):
    """The native dense product keeps a bfloat16 folder's matrices at 2 bytes a value (float32 ones in the
    activations' dtype: 4 bytes, or 2 on a CPU whose default is bfloat16), and the plan counts them so before
    loading."""
    model = random_llama(llama_config(vocab_size=1000)).to(dtype)
    loaded = load_model(str(save_hf_folder(model, tmp_path)), memory=MemoryRequest(n_ctx=256), progress=False)
    assert {linear_kind(m) for m in loaded.decoder.matrices()} == {"dense native"}
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    held = dtype if dtype == torch.bfloat16 else getattr(torch, loaded.decoder.settings.dtype)
    assert sum(m.nbytes for m in loaded.decoder.matrices()[1:]) == matrices * held.itemsize
    assert loaded.plan.weights == pytest.approx(loaded.decoder.nbytes, rel=0.01)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_the_plan_is_what_the_decoder_holds(smollm2_gguf_path, qwen_gguf_path, dtype):
    """Counted from the header before loading, compared with the loaded decoder's own tensors."""
    for path in (smollm2_gguf_path, qwen_gguf_path):
        model = load_model(str(path), dtype, memory=MemoryRequest(n_ctx=512))
        assert model.plan.weights == pytest.approx(model.decoder.nbytes, rel=0.01), path.name


def test_llm_refuses_a_context_that_does_not_fit_a_loaded_model(smollm2_gguf_path, monkeypatch):
    model = load_model(str(smollm2_gguf_path), memory=MemoryRequest(n_ctx=512))
    limited(monkeypatch, 500 * MiB, in_use=model.decoder.nbytes + 100 * MiB)  # 2-byte KV (bf16 or f16)
    with pytest.raises(MemoryPlanError, match=r"KV cache .*n_ctx 65536"):
        LLM(model, n_ctx=65536)
    assert LLM(model).engine.n_ctx < 8192  # what fits


def test_a_cgroup_limit_is_found(tmp_path, monkeypatch):
    """cgroup v1 and v2 files as Linux lays them out; the tightest of a cgroup and its parents counts."""
    (tmp_path / "kvlm" / "job").mkdir(parents=True)
    (tmp_path / "kvlm" / "memory.max").write_text("2147483648\n")
    (tmp_path / "kvlm" / "job" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kvlm/job\n")
    monkeypatch.setattr(memory_plan, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory_plan, "PROC_CGROUP", proc)
    assert memory_plan.memory_limit() == (2147483648, "cgroup limit")
    (tmp_path / "memory" / "box").mkdir(parents=True)
    (tmp_path / "memory" / "box" / "memory.limit_in_bytes").write_text("1073741824\n")
    proc.write_text("4:memory:/box\n")
    assert memory_plan.memory_limit() == (1073741824, "cgroup limit")


@pytest.mark.parametrize("text, size", [("6GiB", 6 << 30), ("6G", 6 << 30), ("512MiB", 512 << 20), ("6GB", 6 * 10**9),
                                        ("123456", 123456), ("1.5g", 3 << 29)])
def test_sizes_are_read_as_people_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["6X", "lots", "GiB", "6i"])
def test_a_size_that_is_not_one_names_itself(text):
    with pytest.raises(ValueError, match=f"not a size: '{text}'"):
        parse_size(text)
