"""`kvlm inspect` for a model with sliding-window layers: the bytes of iSWA's full and sliding pools beside one full
cache (--swa-full), for the real Gemma 3 270M and, against what the memory really allocates, a random Gemma 3;
for models with recurrent layers (a random LFM2: KV bytes of its attention layers only and the conv layers' state;
a random Mamba2: no KV cache, the state alone); and --swa-full from the command line to the engine."""
from __future__ import annotations

import io
import logging
import re

import pytest
from helpers.gemma3_factory import WINDOW, random_gemma3
from helpers.gguf_factory import save_hf_folder
from helpers.recurrent_factory import random_lfm2, random_mamba2

import kvlm.cli.commands
import kvlm.engine.llm
import kvlm.server.serve
from kvlm import Context, load_model
from kvlm.memory.layout import HYBRID, ISWA, RECURRENT, UNIFIED, memory_layout
from kvlm.engine.engine import Engine
from kvlm.memory.kv_store import KV_DTYPES, kv_bytes_for

MiB = 2**20
ISWA_ROW = re.compile(r"(\d+) \([\d.]+ MiB\) = full (\d+) \([\d.]+ MiB\) \+ sliding (\d+) \([\d.]+ MiB\); "
                      r"swa_full (\d+) \([\d.]+ MiB\)")


def inspect_rows(capsys, argv: list[str]) -> dict[str, str]:
    assert kvlm.cli.commands.main(["inspect", *argv]) == 0
    return {line[:20].strip(): line[20:].strip() for line in capsys.readouterr().out.splitlines()}


def test_inspect_gemma3_270m_shows_both_pools_and_the_full_cache(gemma_gguf_path, capsys):
    rows = inspect_rows(capsys, [str(gemma_gguf_path), "--ctx", "32768"])
    assert rows["n_ctx"] == "32768" and rows["sliding_window"] == "512"
    # 18 layers, every sixth full: 3 full and 15 sliding; one KV head of 256
    assert (rows["n_layer"], rows["n_head_kv"], rows["head_dim"]) == ("18", "1", "256")
    assert rows["layer_kinds"] == ", ".join(["5 x sliding_attention, 1 x attention"] * 3)
    assert rows["kv memory"] == "iswa: full pool 3 layers x 32768 cells, sliding pool 15 layers x 1024 cells"
    assert rows["sliding pool cells"] == "min(n_ctx, window 512 x n_seq_max 1 + n_ubatch 512) = 1024"
    assert rows["swa_full"] == "one pool, 18 layers x 32768 cells (--swa-full)"
    element = {"f32": 4, "f16": 2, "bf16": 2}
    for dtype, size in element.items():
        row = 2 * 1 * 256 * size  # K and V of one cell in one layer
        full, sliding, kept = 3 * 32768 * row, 15 * (512 + 512) * row, 18 * 32768 * row
        total, *parts = map(int, ISWA_ROW.fullmatch(rows[f"kv_bytes ({dtype:4})"]).groups())
        assert parts == [full, sliding, kept] and total == full + sliding
    bf16 = [int(n) for n in ISWA_ROW.fullmatch(rows["kv_bytes (bf16)"]).groups()]
    assert bf16 == [111 * MiB, 96 * MiB, 15 * MiB, 576 * MiB]  # 2 x 18 layers x 32768 x 256 x 2 B = 576 MiB
    q8 = [int(n) for n in ISWA_ROW.fullmatch(rows["kv_bytes (q8_0)"]).groups()]
    assert q8 == [n * 34 // 32 // 2 for n in bf16]  # 34 bytes per block of 32 values
    assert "(222.00 MiB) = full 201326592 (192.00 MiB) + sliding 31457280 (30.00 MiB); swa_full 1207959552 " \
           "(1152.00 MiB)" in rows["kv_bytes (f32 )"]


def test_inspect_at_a_context_shorter_than_a_window_and_a_batch(gemma_gguf_path, capsys):
    rows = inspect_rows(capsys, [str(gemma_gguf_path), "--ctx", "600"])
    assert rows["sliding pool cells"].endswith("= 600")  # never more than n_ctx
    total, full, sliding, kept = map(int, ISWA_ROW.fullmatch(rows["kv_bytes (f16 )"]).groups())
    assert (full, sliding, kept) == (3 * 600 * 1024, 15 * 600 * 1024, 18 * 600 * 1024) and total == kept


def test_inspect_of_a_unified_model_is_unchanged(smollm2_gguf_path, capsys):
    rows = inspect_rows(capsys, [str(smollm2_gguf_path), "--ctx", "4096"])
    assert not {"kv memory", "sliding pool cells", "swa_full"} & set(rows)
    f32 = 2 * 30 * 4096 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    assert rows["kv_bytes (f32 )"] == f"{f32} ({f32 / MiB:.2f} MiB)"
    assert rows["kv_bytes (bf16)"] == f"{f32 // 2} ({f32 / 2 / MiB:.2f} MiB)"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, one_thread):
    folder = tmp_path_factory.mktemp("gemma3-inspect")
    save_hf_folder(random_gemma3(), folder)
    return load_model(str(folder), "float32")


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("n_ctx", [2048, 300])
def test_inspect_sizes_are_what_the_memory_allocates(gemma, dtype, n_ctx):
    config = gemma.config
    layout = memory_layout(config, n_ctx)
    assert layout.kind == ISWA
    full_pool, sliding_pool = layout.pools
    full_layers, full_cells = len(full_pool.layers), full_pool.n_cells
    sliding_layers, sliding_cells = len(sliding_pool.layers), sliding_pool.n_cells
    assert (full_layers, sliding_layers) == (1, 6) and full_cells == n_ctx
    assert sliding_cells == min(n_ctx, WINDOW + 512)
    memory = Context(gemma, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_seq_max=1, kv_dtype=dtype).memory
    full, sliding = memory.pools
    assert (full.n_cells, sliding.n_cells) == (full_cells, sliding_cells)
    assert full.kv_bytes == kv_bytes_for(config, full_cells, dtype, full_layers)
    assert sliding.kv_bytes == kv_bytes_for(config, sliding_cells, dtype, sliding_layers)
    assert memory.kv_bytes == layout.nbytes(config, dtype, 1)
    kept = Context(gemma, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_seq_max=1, kv_dtype=dtype, swa_full=True).memory
    assert kept.kv_bytes == kv_bytes_for(config, n_ctx, dtype) == memory_layout(config, n_ctx, swa_full=True).nbytes(
        config, dtype, 1)


def test_a_model_without_sliding_layers_has_one_pool(smollm2):
    layout = memory_layout(smollm2.config, 4096)
    assert layout.kind == UNIFIED and [(pool.name, len(pool.layers), pool.n_cells) for pool in layout.pools] == [
        ("kv", smollm2.config.n_layer, 4096)]


# --- models with recurrent layers ---

@pytest.fixture(scope="module", params=["lfm2", "mamba2"])
def recurrent_folder(request, tmp_path_factory, one_thread):
    reference = {"lfm2": random_lfm2, "mamba2": random_mamba2}[request.param]()
    folder = tmp_path_factory.mktemp(f"{request.param}-inspect")
    save_hf_folder(reference, folder)
    return request.param, reference.config, folder


def expected_sizes(name: str, c, n_ctx: int) -> tuple[int, int, dict[str, int]]:
    """(attention layers, float32 bytes of one sequence's recurrent state, KV bytes by dtype), from the
    transformers config: LFM2's conv layers keep their last conv_L_cache - 1 inputs of hidden_size channels; a
    Mamba2 layer the last conv_kernel - 1 inputs of x, B and C and an SSM state of state_size per head channel."""
    if name == "lfm2":
        n_attention, n_conv = c.layer_types.count("full_attention"), c.layer_types.count("conv")
        state = n_conv * c.hidden_size * (c.conv_L_cache - 1) * 4
        row = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)  # K and V of a cell in a layer
        kv = {dtype: n_attention * n_ctx * row * size for dtype, size in {"f32": 4, "f16": 2, "bf16": 2}.items()}
        kv["q8_0"] = n_attention * n_ctx * row * 34 // 32  # blocks of 32 values in 34 bytes
        return n_attention, state, kv
    conv = (c.expand * c.hidden_size + 2 * c.n_groups * c.state_size) * (c.conv_kernel - 1)
    ssm = c.num_heads * c.head_dim * c.state_size
    return 0, c.num_hidden_layers * (conv + ssm) * 4, {}


def test_inspect_of_recurrent_layers(recurrent_folder, capsys):
    name, c, folder = recurrent_folder
    rows = inspect_rows(capsys, [str(folder), "--ctx", "4096"])
    n_attention, state, kv = expected_sizes(name, c, 4096)
    assert "swa_full" not in rows and "sliding pool cells" not in rows
    assert rows["recurrent state"].startswith(f"{2 * state} ({2 * state / MiB:.2f} MiB) for n_seq_max 1 in 2 banks "
                                              "(committed, being written), f32: ")
    kv_rows = {key: value for key, value in rows.items() if key.startswith("kv_bytes")}
    if name == "mamba2":
        assert state == 3 * ((128 + 2 * 2 * 16) * 3 + 8 * 16 * 16) * 4 == 31488
        assert rows["kv memory"] == "recurrent: no KV cache, recurrent state for 3 mamba layers"
        assert rows["recurrent state"].endswith("f32: 3 mamba layers x [192x3 + 8x16x16] per sequence")
        assert kv_rows == {}  # no attention layer: no KV at all
        return
    assert (n_attention, state) == (2, 4 * 64 * 2 * 4)
    assert rows["kv memory"] == ("hybrid: KV cache for 2 attention layers x 4096 cells, recurrent state for "
                                 "4 conv layers")
    assert rows["recurrent state"].endswith("f32: 4 conv layers x [64x2] per sequence")
    assert kv_rows == {f"kv_bytes ({dtype:4})": f"{size} ({size / MiB:.2f} MiB) for 2 attention layers of 6"
                       for dtype, size in kv.items()}
    assert kv["f32"] == 2 * 2 * 4096 * 2 * 16 * 4  # not 6 layers' worth


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])  # q8_0 needs a head_dim of 32 or more; this LFM2's is 16
def test_inspect_recurrent_sizes_are_what_the_memory_allocates(recurrent_folder, dtype):
    name, c, folder = recurrent_folder
    model = load_model(str(folder), "float32")
    n_attention, state, kv = expected_sizes(name, c, 300)
    layout = memory_layout(model.config, 300)
    assert layout.kind == (HYBRID if n_attention else RECURRENT)
    assert (sum(len(pool.layers) for pool in layout.pools), layout.state_bytes) == (n_attention, state)
    memory = Context(model, n_ctx=300, n_batch=512, n_ubatch=512, n_seq_max=1, kv_dtype=dtype).memory
    slots = memory.recurrent if name == "lfm2" else memory
    assert slots.kv_bytes == 2 * state  # two banks: the committed state and the one a batch writes
    assert memory.kv_bytes == layout.nbytes(model.config, dtype, n_seq_max=1)
    if name == "lfm2":
        assert memory.attention.kv_bytes == kv[dtype] == kv_bytes_for(model.config, 300, dtype, n_attention)
        assert memory.kv_bytes == kv[dtype] + 2 * state
    else:
        assert memory.pools == () and memory.kv_bytes == 2 * state


# --- --swa-full reaches the engine ---

@pytest.fixture
def engines(gemma, monkeypatch) -> list[Engine]:
    """Every Engine the CLI builds, on the random Gemma 3 whatever --model says."""
    built = []

    class RecordingEngine(Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    for module in (kvlm.cli.commands, kvlm.engine.llm, kvlm.server.serve):
        monkeypatch.setattr(module, "load_model", lambda *args, **kwargs: gemma, raising=False)
    monkeypatch.setattr(kvlm.engine.llm, "Engine", RecordingEngine)
    monkeypatch.setattr(kvlm.server.serve, "Engine", RecordingEngine)
    return built


@pytest.mark.parametrize("flag, kind", [([], "iswa"), (["--swa-full"], "unified")])
def test_generate_passes_swa_full(engines, capsys, flag, kind):
    argv = ["generate", "--prompt", "abc", "--max-tokens", "3", "--n-ctx", "64", "--json", *flag]
    assert kvlm.cli.commands.main(argv) == 0
    [engine] = engines
    assert engine.context.memory.kind == kind
    assert [pool.name for pool in engine.context.memory.pools] == (["full", "sliding"] if kind == "iswa" else ["kv"])


@pytest.mark.parametrize("flag, kind", [([], "iswa"), (["--swa-full"], "unified")])
def test_chat_passes_swa_full(engines, monkeypatch, flag, kind):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # ends at once: only the engine is built
    assert kvlm.cli.commands.main(["chat", "--n-ctx", "64", *flag]) == 0
    [engine] = engines
    assert engine.context.memory.kind == kind


@pytest.mark.parametrize("flag, kind", [([], "iswa"), (["--swa-full"], "unified")])
def test_serve_passes_swa_full(engines, monkeypatch, caplog, flag, kind):
    """Down to the engine `serve` builds; the app and uvicorn are stand-ins that return at once."""
    monkeypatch.setattr(kvlm.server.serve, "create_app", lambda *args, **kwargs: None)
    monkeypatch.setattr(kvlm.server.serve.uvicorn, "Config", lambda *args, **kwargs: None)
    monkeypatch.setattr(kvlm.server.serve.uvicorn, "Server", lambda config: type("S", (), {"run": lambda s: None})())
    monkeypatch.setattr(kvlm.server.serve.signal, "signal", lambda *args: None)
    with caplog.at_level(logging.INFO, logger="kvlm"):
        assert kvlm.cli.commands.main(["serve", "--n-ctx", "256", "--max-num-seqs", "2", *flag]) == 0
    [engine] = engines
    assert engine.context.memory.kind == kind
    pools = ("KV cache (iswa): full pool 256 cells x 1 layer, sliding pool 256 cells x 6 layers (window 8)"
             if kind == "iswa" else "KV cache: 256 cells x 7 layers")  # one pool: as it always was
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(pools)]
    assert logged == [f"{pools}, f32: {engine.context.memory.kv_bytes} bytes "
                      f"({engine.context.memory.kv_bytes / MiB:.1f} MiB); up to 2 sequences"]


def test_swa_full_is_off_unless_asked_and_documented():
    parser = kvlm.cli.commands._parser()
    for command in (["generate", "--prompt", "x"], ["chat"], ["serve"]):
        assert parser.parse_args(command).swa_full is False
        assert parser.parse_args([*command, "--swa-full"]).swa_full is True
    assert kvlm.server.serve.ServeSettings(model="m").swa_full is False
