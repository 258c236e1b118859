"""Tensor-parallel shards (issue 15): how a model's tensors are cut between ranks, and which sizes are refused.
test_tensor_parallel_engine.py and test_tensor_parallel_qwen.py run sharded models on two processes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gguf_factory import llama_config, random_llama, save_hf_folder
from kvlm.families import CONV
from kvlm.fetch import resolve_model
from kvlm.load import read_model
from kvlm.parallel.shard import COLUMN_PARALLEL, ROW_PARALLEL, check_tensor_parallel, shard_config, shard_weights


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """GQA 8:4: two ranks get 4 query heads and 2 KV heads each."""
    config = llama_config(hidden_size=128, n_head=8, n_head_kv=4, n_layer=3, intermediate_size=192)
    folder = save_hf_folder(random_llama(config, seed=3), tmp_path_factory.mktemp("tp-llama"))
    return read_model(resolve_model(str(folder)))[1]


def test_each_rank_holds_its_share_of_the_heads_and_the_mlp(weights):
    shard = shard_config(weights.config, 2)
    assert (shard.n_head, shard.n_head_kv, shard.n_ff) == (4, 2, 96)


def test_the_ranks_shards_put_together_are_the_whole_model(weights):
    """Column-parallel tensors are cut by rows, row-parallel ones by columns, the LM head by vocabulary (its own
    tensor even when tied to the embedding); everything else is replicated."""
    shards = [shard_weights(weights, rank, 2).tensors for rank in range(2)]
    assert torch.equal(torch.cat([s["output.weight"] for s in shards]), weights.output)
    for name, tensor in weights.tensors.items():
        if name == "output.weight":
            continue
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if part in COLUMN_PARALLEL:
            assert torch.equal(torch.cat([s[name] for s in shards]), tensor), name
        elif part in ROW_PARALLEL:
            assert torch.equal(torch.cat([s[name] for s in shards], dim=1), tensor), name
        else:
            assert all(torch.equal(s[name], tensor) for s in shards), name


def test_a_size_that_does_not_divide_the_heads_is_refused(weights):
    config = dataclasses.replace(weights.config, n_head=9, n_head_kv=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide n_head = 9, n_head_kv = 3 .*"
                                         r"sizes that work: 1, 3\)"):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel(config, 0)


def test_recurrent_layers_are_refused(weights):
    config = dataclasses.replace(weights.config, layer_kinds=(CONV, *weights.config.layer_kinds[1:]), conv_kernel=3)
    with pytest.raises(ValueError, match=f"not supported for models with {CONV} layers"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 1)
