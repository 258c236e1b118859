"""Loading streams the file one tensor at a time (issue 22): a load's peak resident memory stays within 10% of what
the process holds after it, and a quantized file's weights take about the file's size. Measured in a child process
(its VmHWM: getrusage's ru_maxrss would carry this test process's own peak through the child's exec), on a
random-weight GGUF of a few hundred MB in a Q4_K_M-like mix of formats."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFWriter

from helpers.blocks import random_blocks
from helpers.gguf_factory import add_value, gguf_metadata, llama_config
from kvlm.kernels import native_kernels

# Llama shapes at a few hundred MB: 8 layers of width 2048, MLP 8192, GQA 16:4.
SHAPE = dict(vocab_size=3000, hidden_size=2048, n_head=16, n_head_kv=4, n_layer=8, intermediate_size=8192)
MiB = 1 << 20


def quantized_mix(name: str) -> T:
    """llama.cpp's Q4_K_M: Q6_K for the down projections and the embedding, Q4_K for the rest."""
    return T.Q6_K if name.endswith(("ffn_down.weight", "token_embd.weight")) else T.Q4_K


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    d, ff, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * d_head(config)
    shapes = {"token_embd.weight": (config.vocab_size, d), "output_norm.weight": (d,)}
    for i in range(config.num_hidden_layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
                       f"blk.{i}.attn_q.weight": (d, d), f"blk.{i}.attn_k.weight": (kv, d),
                       f"blk.{i}.attn_v.weight": (kv, d), f"blk.{i}.attn_output.weight": (d, d),
                       f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
                       f"blk.{i}.ffn_down.weight": (d, ff)})
    return shapes


def d_head(config) -> int:
    return config.hidden_size // config.num_attention_heads


@pytest.fixture(scope="module")
def big_gguf(tmp_path_factory) -> Path:
    """Written with gguf's writer, one tensor at a time; random blocks with plausible scales (no float model)."""
    config = llama_config(**SHAPE)
    path = tmp_path_factory.mktemp("big") / "model.gguf"
    writer = GGUFWriter(path, "llama")
    for key, value in gguf_metadata(config).items():
        add_value(writer, key, value)
    for index, (name, shape) in enumerate(tensor_shapes(config).items()):
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            qtype = quantized_mix(name)
            writer.add_tensor(name, random_blocks(qtype, *shape, seed=index), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LOAD = """
import json, sys, kvlm
from kvlm.kernels import native_kernels
from kvlm.loader.load import load_model
from kvlm.loader.memory_plan import MemoryRequest, peak_resident_bytes, resident_bytes
native_kernels()  # built and loaded before measuring
before = resident_bytes()
budget = int(sys.argv[2]) if len(sys.argv) > 2 else None
model = load_model(sys.argv[1], memory=MemoryRequest(n_ctx=512), memory_budget=budget, progress=False)
print(json.dumps({"before": before, "after": resident_bytes(), "peak": peak_resident_bytes(),
                  "weights": model.plan.weights, "held": model.decoder.nbytes,
                  "describe": model.decoder.describe()}))
"""


def load_in_child(path: Path, budget: int | None = None) -> dict:
    args = [sys.executable, "-c", LOAD, str(path)] + ([str(budget)] if budget else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(native_kernels() is None, reason="without the native kernels, weights are dense by design")
def test_a_quantized_file_is_held_at_about_its_size_and_loading_peaks_within_ten_percent(big_gguf):
    size = big_gguf.stat().st_size
    assert size > 250 * MiB
    plain = load_in_child(big_gguf, budget=size + 600 * MiB)
    held = plain["after"] - plain["before"]
    assert plain["weights"] <= 1.01 * size
    assert held <= 1.2 * size, f"{held / MiB:.0f} MiB resident for a {size / MiB:.0f} MiB file"
    assert plain["peak"] <= 1.1 * plain["after"], f"peak {plain['peak'] / MiB:.0f} MiB, after {plain['after'] / MiB:.0f}"


def test_without_the_kernels_a_quantized_file_loads_dense(big_gguf):
    """The fallback holds dense weights (bf16 or float32): the plan says so before loading."""
    from kvlm.loader.gguf_file import open_gguf_model
    from kvlm.loader.memory_plan import weight_bytes
    from kvlm.model.settings import resolve_settings

    config, weights, _ = open_gguf_model(big_gguf)
    settings = resolve_settings("bfloat16", kernels=False)
    held = weight_bytes(config, weights, settings, kernels=False)
    params = sum(int(np.prod(weights.entry(n).shape)) for n in weights.names())
    tied_head = 2 * int(np.prod(weights.entry("token_embd.weight").shape))  # a packed copy of the dense table
    assert held == 2 * params + tied_head
    blocks = sum(weights.entry(n).nbytes for n in weights.names())
    assert blocks == pytest.approx(big_gguf.stat().st_size, rel=0.01)
