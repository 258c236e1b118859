"""`GET /kv`'s report, checked against a cell-by-cell count on a pool with holes and shared cells; its two pools
for a model with sliding-window layers (a random Gemma 3, window 8) in the middle of long generations; the state
slots of models with recurrent layers (a random Mamba2: slots only; a random LFM2: a KV pool and slots); and the
page at /kv/view drawing such reports in a real browser."""
from __future__ import annotations

import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

import numpy as np
import pytest
from helpers.browser import CHROMIUM, render_page
from helpers.gemma3_factory import WINDOW, random_gemma3
from helpers.gguf_factory import save_hf_folder
from helpers.models import token_ids
from helpers.recurrent_factory import random_lfm2, random_mamba2
from prometheus_client.parser import text_string_to_metric_families

from kvlm import LLM, load_model
from kvlm.engine.engine import DEFAULT_DISK_TIER, PREFIX_CACHE_SEQ, Engine
from kvlm.sampling.params import SamplingParams
from kvlm.memory.iswa import sliding_pool_cells
from kvlm.server.kv_report import kv_report
from kvlm.server.metrics import ServerMetrics
from kvlm.server.serve import ServeSettings, serve

POOL_KEYS = {"name", "window", "n_layer", "n_cells", "n_used", "n_free", "kv_bytes", "n_request_cells",
             "n_prefix_cache_only_cells", "cells", "sequences", "fragmentation"}
BLOCK = 16  # the engine's prefix-cache block: a sequence keeps BLOCK - 1 positions beyond its window


def place(cells, cell_ids, positions, seq_ids) -> None:
    mask = np.zeros((len(cell_ids), cells.n_seq_max), dtype=bool)
    for row, seqs in enumerate(seq_ids):
        mask[row, list(seqs)] = True
    cells.apply(np.array(cell_ids), np.array(positions), mask)


def test_report_counts_cells_sequences_runs_and_holes(smollm2):
    engine = Engine(smollm2, n_ctx=32, max_num_seqs=3)
    memory = engine.context.memory
    cells = memory.cells
    # cells 0-3: a cached prefix shared by seq 1; 4-5: seq 1 alone; 8-9: seq 2; 12: cache only; 6-7, 10-11 free
    place(cells, [0, 1, 2, 3], [0, 1, 2, 3], [{PREFIX_CACHE_SEQ, 1}] * 4)
    place(cells, [4, 5], [4, 5], [{1}] * 2)
    place(cells, [8, 9], [0, 1], [{2}] * 2)
    place(cells, [12], [0], [{PREFIX_CACHE_SEQ}])
    report = kv_report(engine)

    assert report["kind"] == "unified" and report["kv_bytes"] == memory.kv_bytes
    [pool] = report["pools"]
    assert set(pool) == POOL_KEYS
    assert (pool["name"], pool["window"], pool["n_layer"]) == ("kv", 0, smollm2.config.n_layer)
    assert pool["kv_bytes"] == report["kv_bytes"]
    used = [c for c in range(32) if cells.pos[c] >= 0]
    assert report["n_cells"] == pool["n_cells"] == 32 and report["n_used"] == pool["n_used"] == len(used) == 9
    assert pool["n_free"] == 32 - 9
    assert pool["cells"] == [[c, int(cells.pos[c]), [int(s) for s in np.flatnonzero(cells.seqs[c])]] for c in used]
    assert report["n_request_cells"] == pool["n_request_cells"] == 8                   # 0-5 and 8-9
    assert report["n_prefix_cache_only_cells"] == pool["n_prefix_cache_only_cells"] == 1  # 12
    by_seq = {s["seq_id"]: s for s in pool["sequences"]}
    assert set(by_seq) == {PREFIX_CACHE_SEQ, 1, 2}
    assert by_seq[PREFIX_CACHE_SEQ]["role"] == "prefix_cache"
    assert by_seq[PREFIX_CACHE_SEQ]["cell_runs"] == [[0, 3], [12, 12]]
    assert by_seq[1]["cell_runs"] == [[0, 5]] and (by_seq[1]["pos_min"], by_seq[1]["pos_max"]) == (0, 5)
    assert by_seq[2]["cell_runs"] == [[8, 9]] and by_seq[2]["n_cells"] == 2
    fragmentation = pool["fragmentation"]
    assert fragmentation["used_max"] == 13
    assert fragmentation["holes"] == 4 and fragmentation["hole_runs"] == 2  # 6-7 and 10-11
    assert fragmentation["largest_free_run"] == 32 - 13
    assert fragmentation["fragmentation"] == round(4 / 13, 4)
    assert all(s["request_id"] is None for s in pool["sequences"])  # no request is running
    # the memory's sequences: the same, with the positions each one is whole over
    assert report["sequences"] == [{"seq_id": s, "request_id": None, "role": by_seq[s]["role"],
                                    "pos_min": by_seq[s]["pos_min"], "pos_max": by_seq[s]["pos_max"]}
                                   for s in sorted(by_seq)]


def test_report_of_an_empty_pool(smollm2):
    report = kv_report(Engine(smollm2, n_ctx=16, max_num_seqs=2))
    [pool] = report["pools"]
    assert "recurrent" not in report  # only for a memory with recurrent layers
    assert report["n_used"] == 0 and report["sequences"] == []
    assert pool["n_used"] == 0 and pool["cells"] == [] and pool["sequences"] == []
    assert pool["fragmentation"] == {"used_max": 0, "holes": 0, "hole_runs": 0, "largest_free_run": 16,
                                     "fragmentation": 0.0}


# --- two pools: a random Gemma 3 with sliding-window layers ---

@pytest.fixture(scope="module")
def gemma(tmp_path_factory, one_thread):
    folder = tmp_path_factory.mktemp("gemma3-kv-report")
    save_hf_folder(random_gemma3(), folder)
    return load_model(str(folder), "float32")


def generating(model, n_steps: int, **kwargs) -> tuple[Engine, list[str]]:
    """An engine with two requests (20- and 13-token prompts) after n_steps steps, both still running."""
    engine = Engine(model, n_ctx=512, max_num_seqs=2, max_num_batched_tokens=16, **kwargs)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(token_ids(1000, n, seed=n), params, request_id=f"req-{n}") for n in (20, 13)]
    for _ in range(n_steps):
        engine.step()
    assert all(not engine.requests[i].finished for i in ids)
    return engine, ids


@pytest.fixture(scope="module")
def iswa_engine(gemma):
    return generating(gemma, 120)


def test_a_long_generation_leaves_few_cells_in_the_sliding_pool(iswa_engine):
    engine, ids = iswa_engine
    memory = engine.context.memory
    report = json.loads(json.dumps(kv_report(engine)))  # as the client gets it
    assert report["kind"] == "iswa"
    full, sliding = report["pools"]
    assert set(full) == set(sliding) == POOL_KEYS
    assert (full["name"], full["window"], full["n_layer"]) == ("full", 0, 1)  # layer 5 of 7 is full
    assert (sliding["name"], sliding["window"], sliding["n_layer"]) == ("sliding", WINDOW, 6)
    assert full["n_cells"] == 512
    assert sliding["n_cells"] == sliding_pool_cells(512, WINDOW, 3, 16, BLOCK - 1) == (WINDOW + BLOCK - 1) * 3 + 16
    assert report["kv_bytes"] == full["kv_bytes"] + sliding["kv_bytes"] == memory.kv_bytes
    assert full["kv_bytes"] == memory.full.kv_bytes and sliding["kv_bytes"] == memory.sliding.kv_bytes
    # the memory's counts are the full pool's, which holds every position
    assert (report["n_cells"], report["n_used"]) == (full["n_cells"], full["n_used"]) == (memory.n_cells,
                                                                                           memory.n_used)
    assert report["n_request_cells"] == full["n_request_cells"]
    assert report["n_prefix_cache_only_cells"] == full["n_prefix_cache_only_cells"]

    requests = {engine.requests[i].seq_id: engine.requests[i] for i in ids}
    computed = sum(r.n_computed for r in requests.values())
    assert computed > 200 and full["n_request_cells"] == computed  # every position of both requests
    assert sliding["n_used"] < full["n_used"] and sliding["n_used"] <= sliding["n_cells"]
    for pool in (full, sliding):
        assert len(pool["cells"]) == pool["n_used"]
        assert pool["fragmentation"]["used_max"] <= pool["n_cells"]

    in_full = {s["seq_id"]: s for s in full["sequences"]}
    in_sliding = {s["seq_id"]: s for s in sliding["sequences"]}
    memory_seqs = {s["seq_id"]: s for s in report["sequences"]}
    assert set(in_full) == set(in_sliding) == set(memory_seqs) == {PREFIX_CACHE_SEQ, *requests}
    for seq_id, request in requests.items():
        whole, window = in_full[seq_id], in_sliding[seq_id]
        assert whole["request_id"] == window["request_id"] == memory_seqs[seq_id]["request_id"] == request.request_id
        assert (whole["n_cells"], whole["pos_min"], whole["pos_max"]) == (request.n_computed, 0,
                                                                          request.n_computed - 1)
        # the sliding pool keeps only the last window (and a block's worth more) of positions, in a row
        assert window["pos_max"] == whole["pos_max"]
        assert WINDOW <= window["n_cells"] <= WINDOW + BLOCK
        assert window["pos_min"] == window["pos_max"] - window["n_cells"] + 1
        # the memory's sequence is whole from where the sliding pool starts
        assert memory_seqs[seq_id]["pos_min"] == window["pos_min"] == memory.seq_pos_min(seq_id)
        assert memory_seqs[seq_id]["pos_max"] == whole["pos_max"]
    # the prefix cache's blocks are kept whole in both pools
    cached = in_full[PREFIX_CACHE_SEQ]
    assert cached["role"] == in_sliding[PREFIX_CACHE_SEQ]["role"] == "prefix_cache"
    assert cached["n_cells"] == in_sliding[PREFIX_CACHE_SEQ]["n_cells"] == BLOCK  # the 20-token prompt's block
    assert memory_seqs[PREFIX_CACHE_SEQ]["pos_min"] == 0


def test_with_swa_full_the_report_has_one_pool_of_every_position(gemma):
    engine, ids = generating(gemma, 40, swa_full=True)
    report = kv_report(engine)
    assert report["kind"] == "unified"
    [pool] = report["pools"]
    assert (pool["name"], pool["window"], pool["n_layer"], pool["n_cells"]) == ("kv", 0, 7, 512)
    assert pool["n_request_cells"] == sum(engine.requests[i].n_computed for i in ids)


def test_metrics_count_cells_per_pool(iswa_engine):
    engine, _ = iswa_engine
    metrics = ServerMetrics()
    metrics.refresh(engine)
    samples = {(s.name, s.labels.get("pool")): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    full, sliding = engine.context.memory.pools
    assert samples[("kvlm_kv_cells_total", None)] == samples[("kvlm_kv_pool_cells_total", "full")] == 512
    assert samples[("kvlm_kv_pool_cells_total", "sliding")] == sliding.n_cells
    assert samples[("kvlm_kv_pool_cells_used", "full")] == full.n_used == samples[("kvlm_kv_cells_used", None)]
    assert samples[("kvlm_kv_pool_cells_used", "sliding")] == sliding.n_used
    assert samples[("kvlm_recurrent_slots_total", None)] == samples[("kvlm_recurrent_slots_used", None)] == 0


# --- recurrent state slots: a random Mamba2 (recurrent memory) and a random LFM2 (hybrid memory) ---

RECURRENT = {"mamba2": random_mamba2, "lfm2": random_lfm2}
RECURRENT_KEYS = {"n_slots", "n_used", "n_layer", "state_bytes", "bytes_per_slot", "slots"}


def state_floats_per_slot(hf_config) -> tuple[int, int]:
    """(recurrent layers, float32 values of one sequence's state), from the transformers config: an LFM2 conv layer
    keeps its last conv_L_cache - 1 inputs of hidden_size channels; a Mamba2 layer the last conv_kernel - 1 inputs
    of its convolution (x, B and C: expand x hidden + 2 x groups x state channels) and an SSM state per head."""
    if hf_config.model_type == "lfm2":
        n_conv = hf_config.layer_types.count("conv")
        return n_conv, n_conv * hf_config.hidden_size * (hf_config.conv_L_cache - 1)
    conv_channels = hf_config.expand * hf_config.hidden_size + 2 * hf_config.n_groups * hf_config.state_size
    per_layer = conv_channels * (hf_config.conv_kernel - 1) + hf_config.num_heads * hf_config.head_dim * \
        hf_config.state_size
    return hf_config.num_hidden_layers, hf_config.num_hidden_layers * per_layer


@pytest.fixture(scope="module", params=list(RECURRENT))
def recurrent_model(request, tmp_path_factory, one_thread):
    reference = RECURRENT[request.param]()
    folder = tmp_path_factory.mktemp(f"{request.param}-kv-report")
    save_hf_folder(reference, folder)
    return request.param, reference.config, load_model(str(folder), "float32")


@pytest.fixture(scope="module")
def recurrent_engine(recurrent_model):
    name, hf_config, model = recurrent_model
    # prefix caching off: every slot and cell is a request's (the prefix cache's cells: the unified tests above)
    return name, hf_config, *generating(model, 6, enable_prefix_caching=False)


def test_report_of_recurrent_slots_after_a_few_steps(recurrent_engine):
    name, hf_config, engine, ids = recurrent_engine
    memory = engine.context.memory
    report = json.loads(json.dumps(kv_report(engine)))  # as the client gets it
    assert report["kind"] == {"mamba2": "recurrent", "lfm2": "hybrid"}[name]
    recurrent = report["recurrent"]
    assert set(recurrent) == RECURRENT_KEYS
    slots = memory if name == "mamba2" else memory.recurrent
    # one slot per sequence id: the engine's max_num_seqs (2) and the prefix cache's id (caching off here)
    n_layer, floats = state_floats_per_slot(hf_config)
    assert (recurrent["n_slots"], recurrent["n_layer"]) == (3, n_layer)
    assert recurrent["bytes_per_slot"] == 2 * floats * 4  # float32, in two banks
    assert recurrent["state_bytes"] == 3 * 2 * floats * 4 == slots.kv_bytes
    assert recurrent["state_bytes"] == sum(s.numel() * s.element_size() for layer in slots.banks for s in layer)

    requests = sorted((engine.requests[i] for i in ids), key=lambda r: r.seq_id)
    assert all(r.n_computed > len(r.prompt_token_ids) for r in requests)  # both past their prompts
    expected = [{"seq_id": r.seq_id, "request_id": r.request_id, "role": "request", "pos_min": 0,
                 "pos_max": r.n_computed - 1} for r in requests]
    assert recurrent["n_used"] == 2 and recurrent["slots"] == expected
    assert report["sequences"] == expected  # the memory's sequences: the same two

    if name == "mamba2":  # no KV cells at all: the memory's counts are its slots'
        assert report["pools"] == []
        assert (report["n_cells"], report["n_used"]) == (3, 2) == (memory.n_cells, memory.n_used)
        assert report["n_request_cells"] == report["n_prefix_cache_only_cells"] == 0
        assert report["kv_bytes"] == recurrent["state_bytes"] == memory.kv_bytes
        return
    # LFM2: the attention layers' KV pool as for a unified memory, besides the slots
    [pool] = report["pools"]
    assert set(pool) == POOL_KEYS
    n_attention = hf_config.layer_types.count("full_attention")
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    assert (pool["name"], pool["window"], pool["n_layer"], pool["n_cells"]) == ("kv", 0, n_attention, 512)
    assert pool["kv_bytes"] == 2 * n_attention * 512 * hf_config.num_key_value_heads * head_dim * 4
    assert report["kv_bytes"] == pool["kv_bytes"] + recurrent["state_bytes"] == memory.kv_bytes
    computed = sum(r.n_computed for r in requests)
    assert report["n_request_cells"] == pool["n_request_cells"] == pool["n_used"] == report["n_used"] == computed
    assert report["n_cells"] == 512 and report["n_prefix_cache_only_cells"] == 0
    assert [(s["seq_id"], s["n_cells"], s["pos_max"]) for s in pool["sequences"]] == [
        (r.seq_id, r.n_computed, r.n_computed - 1) for r in requests]


def test_metrics_count_recurrent_slots(recurrent_engine):
    name, _, engine, _ = recurrent_engine
    metrics = ServerMetrics()
    metrics.refresh(engine)
    samples = {(s.name, s.labels.get("pool")): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert (samples[("kvlm_recurrent_slots_used", None)], samples[("kvlm_recurrent_slots_total", None)]) == (2, 3)
    memory = engine.context.memory
    if name == "mamba2":  # no KV cells
        assert samples[("kvlm_kv_cells_total", None)] == samples[("kvlm_kv_cells_used", None)] == 0
        assert not any(key[0].startswith("kvlm_kv_pool_cells") for key in samples)
    else:
        [pool] = memory.pools
        assert samples[("kvlm_kv_cells_total", None)] == samples[("kvlm_kv_pool_cells_total", "kv")] == 512
        assert samples[("kvlm_kv_cells_used", None)] == samples[("kvlm_kv_pool_cells_used", "kv")] == pool.n_used


def test_report_and_metrics_show_the_state_copies_kept_for_prefix_reuse(recurrent_model):
    """Prefix caching on, after 6 steps: the 20-token prompt's copy at its last block boundary (16), kept when the
    prompt was done; the 13-token request's latest copy, taken when its decoding reached position 16 (kept when it
    ends)."""
    _, _, model = recurrent_model
    engine, _ = generating(model, 6)
    copies = engine.checkpoints
    assert copies.n_states == 2 and copies.capacity == 4
    report = json.loads(json.dumps(kv_report(engine)))
    assert report["recurrent"]["state_copies"] == {"n_states": 2, "capacity": 4, "bytes": copies.n_bytes}
    assert copies.n_bytes == report["recurrent"]["bytes_per_slot"]  # two copies of one state; a slot has two banks
    metrics = ServerMetrics()
    metrics.refresh(engine)
    samples = {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples}
    assert (samples["kvlm_prefix_state_copies"], samples["kvlm_prefix_state_copy_bytes"]) == (2, copies.n_bytes)


def test_serve_logs_the_recurrent_state(recurrent_model, monkeypatch, caplog):
    """`serve` down to its log lines, with the app and uvicorn as stand-ins that return at once."""
    name, hf_config, model = recurrent_model
    built = []
    monkeypatch.setattr("kvlm.server.serve.load_model", lambda *args, **kwargs: model)
    monkeypatch.setattr("kvlm.server.serve.create_app",
                        lambda models, **kwargs: built.extend(e.served.engine for e in models.loaded))
    monkeypatch.setattr("kvlm.server.serve.uvicorn.Config", lambda *args, **kwargs: None)
    monkeypatch.setattr("kvlm.server.serve.uvicorn.Server", lambda config: type("S", (), {"run": lambda s: None})())
    monkeypatch.setattr("kvlm.server.serve.signal.signal", lambda *args: None)
    with caplog.at_level(logging.INFO, logger="kvlm"):
        assert serve(ServeSettings(model="m", n_ctx=256, max_num_seqs=2)) == 0
    [engine] = built
    memory = engine.context.memory
    n_layer, floats = state_floats_per_slot(hf_config)
    messages = [r.getMessage() for r in caplog.records]
    state = 3 * 2 * floats * 4  # two banks a slot
    assert (f"recurrent state: 3 slots x 2 banks x {floats * 4} bytes ({n_layer} layers, float32): {state} bytes "
            f"({state / 2**20:.1f} MiB)") in messages
    if name == "mamba2":
        assert "no KV cache (recurrent memory: no attention layers); up to 2 sequences" in messages
        assert not any(m.startswith("KV cache") for m in messages)
    else:
        kv = memory.kv_bytes - state
        assert kv == memory.attention.kv_bytes
        assert f"KV cache (hybrid): 256 cells x 2 layers, f32: {kv} bytes ({kv / 2**20:.1f} MiB); up to 2 sequences" \
            in messages


# --- the page, in a real browser, on reports taken in the middle of generations ---

class _Serve(BaseHTTPRequestHandler):
    """/kv/view as the app serves it, and a fixed /kv report."""
    report: dict = {}

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/kv":
            body, kind = json.dumps(self.report).encode(), "application/json"
        elif self.path == "/kv/view":
            body = resources.files("kvlm.server").joinpath("kv_view.html").read_bytes()
            kind = "text/html; charset=utf-8"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def render(report: dict, tmp_path) -> tuple[str, bytes]:
    """The page's DOM and a screenshot, with /kv answering `report`."""
    handler = type("Handler", (_Serve,), {"report": report})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/kv/view"
        dom, shot = render_page(tmp_path, url, 900)
    finally:
        server.shutdown()
        thread.join()
    return dom, shot.read_bytes()


def legend_items(dom: str) -> list[str]:
    return [item.split("</li>")[0] for item in dom.split("<li")[1:]]


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: `make test` installs Debian's chromium "
                                                              "when run as root")


@pytest.mark.browser
@needs_chromium
def test_view_draws_one_grid_per_pool_of_an_iswa_memory(iswa_engine, tmp_path):
    report = kv_report(iswa_engine[0])
    dom, image = render(report, tmp_path)
    assert '<div id="error"></div>' in dom
    assert 'data-kind="iswa"' in dom and 'data-pools="2"' in dom
    assert dom.count("<canvas") == 2
    full, sliding = report["pools"]
    assert f'data-pool="full" data-cells="512" data-used-cells="{full["n_used"]}" data-window="0"' in dom
    assert (f'data-pool="sliding" data-cells="{sliding["n_cells"]}" data-used-cells="{sliding["n_used"]}" '
            f'data-window="{WINDOW}"') in dom
    assert f'data-kv-bytes="{full["kv_bytes"]}"' in dom and f'data-kv-bytes="{sliding["kv_bytes"]}"' in dom
    kib = lambda b: f"{b / 2**10:.1f} KiB"  # noqa: E731  (under a MiB; these sizes round the same in JS)
    assert f"<h2>full pool · 512 cells · every position · 1 layer · {kib(full['kv_bytes'])}</h2>" in dom
    assert (f"<h2>sliding pool · {sliding['n_cells']} cells · window {WINDOW} · 6 layers · "
            f"{kib(sliding['kv_bytes'])}</h2>") in dom
    assert f"iswa memory, 2 pools, {kib(report['kv_bytes'])}: {report['n_used']} of 512 positions held" in dom
    items = legend_items(dom)
    assert len(items) == 3
    for seq in (s for s in sliding["sequences"] if s["role"] == "request"):
        [item] = [i for i in items if f"seq {seq['seq_id']} · request {seq['request_id']}" in i]
        assert f"sliding: {seq['n_cells']} cells, positions {seq['pos_min']}–{seq['pos_max']}" in item
        assert "full: " in item
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and len(image) > 5000


@pytest.mark.browser
@needs_chromium
def test_view_of_recurrent_slots(recurrent_engine, tmp_path):
    """Mamba2: no grid, the slots' summary and list; LFM2: the KV pool's grid as for a unified memory, and a line
    for its slots."""
    name, _, engine, ids = recurrent_engine
    report = kv_report(engine)
    recurrent = report["recurrent"]
    dom, image = render(report, tmp_path)
    assert '<div id="error"></div>' in dom
    kib = lambda b: f"{math.floor(b / 2**10 * 10 + 0.5) / 10:.1f} KiB"  # noqa: E731  (JS's toFixed: half up)
    slots = (f"2 of 3 slots in use, {kib(recurrent['state_bytes'])} of state ({recurrent['n_layer']} layers, "
             f"{kib(recurrent['bytes_per_slot'])} per slot)")
    assert f'data-slots="3" data-used-slots="2" data-state-bytes="{recurrent["state_bytes"]}"' in dom
    assert '<p id="slots-note">' in dom
    if name == "mamba2":
        assert 'data-kind="recurrent"' in dom and 'data-pools="0"' in dom
        assert dom.count("<canvas") == 0 and '<div id="pools"></div>' in dom
        assert "<h1>Recurrent state slots</h1>" in dom
        assert f'<div id="summary">recurrent memory: {slots}</div>' in dom
        assert '<div id="recurrent" hidden="">' in dom and '<p id="grid-note" hidden="">' in dom
    else:
        assert 'data-kind="hybrid"' in dom and 'data-pools="1"' in dom and dom.count("<canvas") == 1
        assert "<h1>KV cache cells</h1>" in dom and "<h2 hidden=" in dom  # one pool: no pool title
        [pool] = report["pools"]
        assert f'<div id="summary">{pool["n_used"]} of 512 cells used: {pool["n_request_cells"]} by requests' in dom
        assert f'<div id="recurrent">recurrent state: {slots}</div>' in dom
        assert '<p id="grid-note">' in dom
    items = legend_items(dom)
    assert len(items) == 2
    for slot in recurrent["slots"]:
        [item] = [i for i in items if f"seq {slot['seq_id']} · request {slot['request_id']}" in i]
        assert f'data-slot-positions="{slot["pos_min"]}-{slot["pos_max"]}"' in item
        assert item.endswith(f"state of positions {slot['pos_min']}–{slot['pos_max']}")
        if name == "lfm2":
            assert f"{slot['pos_max'] + 1} cells · positions 0–{slot['pos_max']} · " in item
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and len(image) > 2000


@pytest.mark.browser
@needs_chromium
def test_view_says_how_many_state_copies_are_kept(recurrent_model, tmp_path):
    _, _, model = recurrent_model
    engine, _ = generating(model, 6)  # prefix caching on: two copies (test_report_and_metrics_show_the_state_...)
    dom, _ = render(kv_report(engine), tmp_path)
    kib = lambda b: f"{math.floor(b / 2**10 * 10 + 0.5) / 10:.1f} KiB"  # noqa: E731  (JS's toFixed: half up)
    assert f"; 2 of 4 state copies kept for prefix reuse ({kib(engine.checkpoints.n_bytes)})</div>" in dom


@pytest.mark.browser
@needs_chromium
def test_view_of_a_unified_memory_is_as_before(smollm2, tmp_path):
    engine = Engine(smollm2, n_ctx=256, max_num_seqs=2)
    engine.add_request(smollm2.tokenizer.encode("A long story begins here."),
                       SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), request_id="cmpl-x")
    for _ in range(5):
        engine.step()
    report = kv_report(engine)
    dom, image = render(report, tmp_path)
    [pool] = report["pools"]
    [seq] = [s for s in pool["sequences"] if s["role"] == "request"]
    assert '<div id="error"></div>' in dom and dom.count("<canvas") == 1
    assert 'data-kind="unified"' in dom and f'data-request-cells="{seq["n_cells"]}"' in dom
    assert "<h2 hidden=" in dom  # no pool title
    assert (f'<div id="summary">{pool["n_used"]} of 256 cells used: {pool["n_request_cells"]} by requests, '
            f'{pool["n_prefix_cache_only_cells"]} only by the prefix cache; 0 holes below cell {pool["n_used"]} '
            f'(fragmentation 0), largest free run {256 - pool["n_used"]}</div>') in dom
    assert any(f"seq {seq['seq_id']} · request cmpl-x · {seq['n_cells']} cells · positions 0–{seq['pos_max']} · "
               f"1 run(s)" in item for item in legend_items(dom))
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and len(image) > 5000


@pytest.fixture(scope="module")
def tiered_engine(smollm2, tmp_path_factory):
    """Two turns of a conversation with a RAM and a disk tier, the cells' prefix cache emptied in between: the
    second loads the 47 positions the first computed from the RAM tier."""
    llm = LLM(smollm2, n_ctx=256, max_num_seqs=2, prefix_cache_ram="64MiB",
              prefix_cache_dir=tmp_path_factory.mktemp("tiers"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = token_ids(1000, 40, seed=1)
    answer = llm.generate([first], params, use_tqdm=False)[0].token_ids
    llm.engine.prefix_cache.clear()
    again = llm.generate([first + answer + token_ids(1000, 5, seed=2)], params, use_tqdm=False)[0]
    assert again.n_cached_tokens == 47
    llm.engine.tiers.flush()
    return llm.engine


def test_report_and_metrics_show_the_prefix_cache_tiers(tiered_engine):
    ram, disk = tiered_engine.tiers.tiers
    assert ram.n_bytes == sum(len(entry.data) for entry in ram.entries.values())
    assert disk.n_bytes == sum(entry.path.stat().st_size for entry in disk.entries.values())
    report = json.loads(json.dumps(kv_report(tiered_engine)))
    assert report["prefix_tiers"] == [
        {"tier": "ram", "entries": 2, "bytes": ram.n_bytes, "capacity": 64 * 2**20, "queries": 2, "hits": 1,
         "hit_tokens": 47},
        {"tier": "disk", "entries": 2, "bytes": disk.n_bytes, "capacity": DEFAULT_DISK_TIER, "queries": 2, "hits": 0,
         "hit_tokens": 0}]
    metrics = ServerMetrics()
    metrics.refresh(tiered_engine)
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    for tier in report["prefix_tiers"]:
        name = tier["tier"]
        assert samples[("kvlm_prefix_tier_queries_total", name)] == tier["queries"]
        assert samples[("kvlm_prefix_tier_hits_total", name)] == tier["hits"]
        assert samples[("kvlm_prefix_tier_hit_tokens_total", name)] == tier["hit_tokens"]
        assert samples[("kvlm_prefix_tier_bytes", name)] == tier["bytes"]
        assert samples[("kvlm_prefix_tier_entries", name)] == tier["entries"]


@pytest.mark.browser
@needs_chromium
def test_view_shows_the_prefix_cache_tiers(tiered_engine, tmp_path):
    report = kv_report(tiered_engine)
    dom, _ = render(report, tmp_path)
    mib = lambda b: f"{math.floor(b / 2**20 * 100 + 0.5) / 100:.2f} MiB"  # noqa: E731  (JS's toFixed: half up)
    ram, disk = report["prefix_tiers"]
    assert (f'<div id="tiers">prefix cache tiers: ram 2 entries, {mib(ram["bytes"])} of 64.00 MiB, 1 of 2 lookups '
            f'hit (47 tokens); disk 2 entries, {mib(disk["bytes"])} of 10.00 GiB, 0 of 2 lookups hit (0 tokens)</div>'
            ) in dom
