"""Tensor-parallel shards (issue 15): how a model's tensors are cut between ranks, and which sizes are refused.
Each rank reads only its part of each tensor (issue 22). test_tensor_parallel_engine.py and
test_tensor_parallel_qwen.py run sharded models on two processes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.gguf_factory import llama_config, random_llama, save_hf_folder
from kvlm.core.family import CONV
from kvlm.kernels import BlockMatrix, dequantize
from kvlm.loader.gguf_file import open_gguf_model
from kvlm.loader.hf_folder import open_hf_folder
from kvlm.loader.shard import COLUMN_PARALLEL, ROW_PARALLEL, check_tensor_parallel, ff_shares, make_shard


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """GQA 8:4: two ranks get 4 query heads and 2 KV heads each."""
    config = llama_config(hidden_size=128, n_head=8, n_head_kv=4, n_layer=3, intermediate_size=192)
    return save_hf_folder(random_llama(config, seed=3), tmp_path_factory.mktemp("tp-llama"))


def sharded(weights, rank: int, size: int):
    """The same weights, reading rank `rank`'s parts only."""
    weights.shard = make_shard(weights.config, {n: weights.file_type(n) for n in weights.names()}, rank, size)
    weights.config = weights.shard.config
    return weights


def values(stored) -> torch.Tensor:
    return dequantize(stored) if isinstance(stored, BlockMatrix) else stored.float()


def test_each_rank_holds_its_share_of_the_heads_and_the_mlp(folder):
    shard = sharded(open_hf_folder(folder)[1], 0, 2).config
    assert (shard.n_head, shard.n_head_kv, shard.n_ff) == (4, 2, 96)


def check_parts_make_the_whole(open_file) -> None:
    """Column-parallel tensors are cut by rows, row-parallel ones by columns, the LM head by vocabulary (its own
    tensor even when tied to the embedding); everything else is replicated."""
    whole = open_file()
    shards = [sharded(open_file(), rank, 2) for rank in range(2)]
    heads = [values(s.output()) for s in shards]
    assert torch.equal(torch.cat(heads), values(whole.read(whole.output_name)))
    for name in whole.names():
        expected = values(whole.read(name))
        parts = [values(s.read(name)) for s in shards]
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part in COLUMN_PARALLEL:
            assert torch.equal(torch.cat(parts), expected), name
        elif part in ROW_PARALLEL:
            assert torch.equal(torch.cat(parts, dim=1), expected), name
        else:
            assert all(torch.equal(p, expected) for p in parts), name


def test_the_ranks_shards_put_together_are_the_whole_model(folder):
    check_parts_make_the_whole(lambda: open_hf_folder(folder)[1])


def test_a_quantized_files_shards_are_its_blocks_cut_at_block_boundaries(qwen_gguf_path):
    """Qwen2.5-0.5B's down projections are Q4_K/Q6_K rows of 4864 = 19 blocks of 256: ranks get 10 and 9 blocks
    (2560 and 2304 wide), and read only those bytes."""
    shards = [sharded(open_gguf_model(qwen_gguf_path)[1], rank, 2) for rank in range(2)]
    assert [s.config.n_ff for s in shards] == [2560, 2304]
    down = [s.read("blk.0.ffn_down.weight") for s in shards]
    assert all(isinstance(d, BlockMatrix) for d in down) and [d.n_cols for d in down] == [2560, 2304]
    check_parts_make_the_whole(lambda: open_gguf_model(qwen_gguf_path)[1])


def test_the_mlp_is_split_at_whole_blocks():
    assert ff_shares(192, 2) == [96, 96]
    assert ff_shares(4864, 2, 256) == [2560, 2304]
    with pytest.raises(ValueError, match="the MLP width 256 holds 1 blocks of 256: too few for 2 ranks"):
        ff_shares(256, 2, 256)


def test_a_size_that_does_not_divide_the_heads_is_refused(folder):
    config = dataclasses.replace(open_hf_folder(folder)[0], n_head=9, n_head_kv=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide n_head = 9, n_head_kv = 3 .*"
                                         r"sizes that work: 1, 3\)"):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel(config, 0)


def test_recurrent_layers_are_refused(folder):
    config = open_hf_folder(folder)[0]
    config = dataclasses.replace(config, layer_kinds=(CONV, *config.layer_kinds[1:]), conv_kernel=3)
    with pytest.raises(ValueError, match=f"not supported for models with {CONV} layers"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 1)


# --- mixtures of experts: every rank holds every expert, with its share of each expert's width ---

@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """A Qwen2-MoE (experts and a gated shared expert) 64 wide each, as a folder and as a Q8_0 GGUF file."""
    from gguf import GGMLQuantizationType
    from helpers.moe_factory import SPECS, random_moe, save_moe_folder, write_moe_gguf

    spec = dataclasses.replace(SPECS["qwen2moe"], options={**SPECS["qwen2moe"].options, "moe_intermediate_size": 64})
    model, folder = random_moe(spec), tmp_path_factory.mktemp("tp-moe")
    hf = save_moe_folder(model, folder / "hf")
    return hf, write_moe_gguf(model, spec, hf, folder / "model.gguf", GGMLQuantizationType.Q8_0)


def expert_values(stored, n_expert: int) -> torch.Tensor:
    value = values(stored)
    return value.reshape(n_expert, -1, value.shape[-1]) if value.dim() == 2 and stored is not None else value


@pytest.mark.parametrize("kind", ["folder", "gguf"])
def test_each_rank_reads_its_share_of_every_experts_width(moe_files, kind):
    def open_file():
        return (open_hf_folder(moe_files[0]) if kind == "folder" else open_gguf_model(moe_files[1]))[1]

    whole = open_file()
    n_expert = whole.config.n_expert
    shards = [sharded(open_file(), rank, 2) for rank in range(2)]
    assert [(s.config.n_ff_exp, s.config.n_ff_shexp) for s in shards] == [(32, 32)] * 2
    for name in whole.names():
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if not part.startswith("ffn_") or part in ("ffn_norm",):
            continue
        expected = whole.read(name)
        parts = [s.read(name) for s in shards]
        if part.endswith("_exps"):
            expected, parts = expert_values(expected, n_expert), [expert_values(p, n_expert) for p in parts]
            dim = 1 if part in COLUMN_PARALLEL else 2
        else:
            expected, parts = values(expected), [values(p) for p in parts]
            dim = 0 if part in COLUMN_PARALLEL else 1
        if part in COLUMN_PARALLEL or part in ROW_PARALLEL:
            assert torch.equal(torch.cat(parts, dim=dim), expected), name
        else:
            assert all(torch.equal(p, expected) for p in parts), name


@pytest.mark.parametrize("kind", ["folder", "mxfp4-gguf"])
def test_gpt_oss_ranks_split_sinks_and_expert_biases_and_keep_the_added_once_biases(tmp_path_factory, kind):
    """gpt-oss's parts beyond other MoE: the sinks go with their heads, the experts' gate and up biases with their
    rows, and the biases added after the ranks' partial sums (attention output, experts' down) are read whole."""
    from gguf import GGMLQuantizationType
    from helpers.gptoss_factory import random_gpt_oss, save_gpt_oss_folder, write_gpt_oss_gguf

    model, folder = random_gpt_oss(), tmp_path_factory.mktemp("tp-gpt-oss")
    path = save_gpt_oss_folder(model, folder) if kind == "folder" else \
        write_gpt_oss_gguf(model, folder / "m.gguf", GGMLQuantizationType.MXFP4)
    open_file = (lambda: open_hf_folder(path)[1]) if kind == "folder" else (lambda: open_gguf_model(path)[1])
    whole, shards = open_file(), [sharded(open_file(), rank, 2) for rank in range(2)]
    for suffix, dim in (("attn_sinks.weight", 0), ("ffn_gate_exps.bias", 1), ("ffn_up_exps.bias", 1),
                        ("attn_output.bias", None), ("ffn_down_exps.bias", None)):
        name = f"blk.1.{suffix}"
        expected, parts = values(whole.read(name)), [values(s.read(name)) for s in shards]
        if dim is None:
            assert all(torch.equal(p, expected) for p in parts), name
        else:
            assert torch.equal(torch.cat(parts, dim=dim), expected), name
