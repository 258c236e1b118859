"""The device choice (kvlm.model.settings, kvlm.model.backends, the memory plan): "auto" on a machine without a GPU is
the CPU; "cuda" where torch sees none is refused naming what torch sees; on a GPU (torch's view of one patched in
here) weights are dense bfloat16, the backend is the Triton one, what the CPU alone does is refused by name, and the
memory plan counts the GPU's memory."""
from __future__ import annotations

import pytest
import torch

from helpers.family_factory import SPECS, family_gguf_metadata, family_gguf_tensors, random_model
from helpers.gguf_factory import write_gguf
from kvlm.loader.gguf_file import open_gguf_model
from kvlm.loader.memory_plan import MemoryPlanError, MemoryRequest, plan_memory
from kvlm.model.backend import TorchBackend
from kvlm.model.backends import backend_for
from kvlm.model.settings import resolve_settings

pytest.importorskip("triton")


@pytest.fixture
def a_gpu(monkeypatch):
    """torch sees one GPU of 8 GiB, 6 of them free."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 << 30, 8 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_auto_is_the_cpu_and_cuda_is_refused_without_a_gpu():
    assert resolve_settings(device="auto").device == "cpu"
    with pytest.raises(ValueError, match=r"device 'cuda': torch .* sees no CUDA GPU here"):
        resolve_settings(device="cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, got 'tpu'"):
        resolve_settings(device="tpu")


def test_on_a_gpu_weights_are_dense_bfloat16_through_triton(a_gpu, monkeypatch):
    monkeypatch.delenv("KVLM_BACKEND", raising=False)
    settings = resolve_settings(device="auto")
    assert (settings.device, settings.dtype, settings.quant, settings.batch_invariant) == ("cuda", "bfloat16",
                                                                                          None, False)
    backend = backend_for(settings)
    assert backend.name == "triton" and backend.device == "cuda"
    reference = resolve_settings("float32", device="cuda")  # the reference mode: torch's ops, on the GPU
    assert reference.reference and type(backend_for(reference)) is TorchBackend
    assert backend_for(reference).device == "cuda"


def test_auto_on_a_gpu_host_stays_on_the_cpu_for_what_only_the_cpu_does(a_gpu):
    assert resolve_settings(quant="int8", device="auto").device == "cpu"
    assert resolve_settings("float32", batch_invariant=True, device="auto").device == "cpu"


def test_the_cpus_backend_is_refused_for_a_gpu(a_gpu, monkeypatch):
    monkeypatch.setenv("KVLM_BACKEND", "cpu")
    with pytest.raises(ValueError, match="KVLM_BACKEND=cpu runs on the CPU, not on device 'cuda'"):
        backend_for(resolve_settings(device="cuda"))


@pytest.mark.parametrize("asked,message", [
    (dict(quant="int8"), "quant 'int8' is the CPU's native kernels'"),
    (dict(compile=True), "compile is not available on cuda yet"),
    (dict(batch_invariant=True), "batch_invariant is not available on cuda yet"),
])
def test_what_only_the_cpu_does_is_refused_on_a_gpu(a_gpu, asked, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings(device="cuda", **asked)


def test_the_memory_plan_counts_the_gpus_memory(a_gpu, tmp_path):
    spec = SPECS["llama-llama3"]
    model = random_model(spec)
    path = write_gguf(tmp_path / "model.gguf", family_gguf_metadata(model, spec), family_gguf_tensors(model, spec),
                      arch=spec.arch)
    config, weights, _ = open_gguf_model(path)
    settings = resolve_settings(device="cuda")
    plan = plan_memory(config, weights, settings, MemoryRequest(n_ctx=64), where="model.gguf")
    assert (plan.limit, plan.limit_source, plan.in_use) == (8 << 30, "NVIDIA Test GPU memory", 2 << 30)
    with pytest.raises(MemoryPlanError, match=r"NVIDIA Test GPU memory 8192(\.0)? MiB, less 2048(\.0)? MiB already"):
        plan_memory(config, weights, settings, MemoryRequest(n_ctx=2**24), where="model.gguf")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_the_cli_refuses_cuda_without_a_gpu_before_reading_the_model(capsys, tmp_path):
    from kvlm.cli.commands import main

    assert main(["generate", "--device", "cuda", "--model", str(tmp_path / "absent.gguf"), "--prompt", "x"]) == 1
    assert "device 'cuda': torch" in capsys.readouterr().err


def test_a_memory_on_a_device_hands_its_views_there_with_host_copies():
    """The memory made under torch.device (as memory_for does for a GPU; "meta" here: a device nothing is computed
    on) allocates its K/V planes there and gives views whose rows, groups and token cells are there too, the token
    cells' offsets and lengths kept on the host, equal to what the CPU memory gives."""
    from kvlm.core.batch import Batch, sanitize
    from kvlm.core.config import ModelConfig
    from kvlm.core.rope import Rope, RopeScaling
    from kvlm.memory.layout import make_memory

    config = ModelConfig(architecture="llama", name="tiny", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                         head_dim=16, vocab_size=100, n_ctx_train=256, rms_norm_eps=1e-6, tie_word_embeddings=True)
    batch = Batch(tokens=[5, 6, 7, 8, 9], seq_ids=[0, 0, 0, 1, 1], logits=[False, False, True, False, True])
    views = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            memory = make_memory(config, [Rope(RopeScaling(), 16)] * 2, 64, 2, 16, "f32")
        ubatches = memory.split(sanitize(batch, vocab_size=100, n_seq_max=2, n_batch=16,
                                         seq_pos_max=memory.seq_pos_max), 16)
        memory.begin()
        views.append(memory.place(ubatches[0], memory.plan(ubatches)[0]))
    on_cpu, on_meta = views
    assert on_meta.store.device.type == "meta" and on_meta.rows.device.type == "meta"
    assert all(t.device.type == "cpu" for group in on_meta.groups for t in (group.tokens, group.index))
    moved = on_meta.groups_on(torch.device("meta"))  # only torch's attention asks: copied once
    assert moved is on_meta.groups_on(torch.device("meta"))
    assert all(t.device.type == "meta" for group in moved for t in (group.tokens, group.index, group.mask)
               if t is not None)
    cells = on_meta.token_cells
    assert cells is on_meta.device_cells and cells.offsets.device.type == "meta"
    assert [a.tolist() for a in cells.on_host()] == [on_cpu.token_cells.offsets.tolist(),
                                                      on_cpu.token_cells.lengths.tolist()]


def test_a_loaded_models_weights_are_counted_once_on_a_gpu(a_gpu):
    """After loading, the card's memory in use includes the weights: the engine's second plan takes them out."""
    from kvlm.core.config import ModelConfig
    from kvlm.loader.memory_plan import fit

    config = ModelConfig(architecture="llama", name="tiny", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                         head_dim=16, vocab_size=100, n_ctx_train=256, rms_norm_eps=1e-6, tie_word_embeddings=True)
    settings = resolve_settings(device="cuda")
    assert fit(config, 1 << 30, settings, MemoryRequest(n_ctx=64)).in_use == 2 << 30
    assert fit(config, 1 << 30, settings, MemoryRequest(n_ctx=64), loaded=True).in_use == 1 << 30
