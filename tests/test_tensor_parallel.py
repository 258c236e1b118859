"""Tensor-parallel shards (issue 15, first part): two processes over gloo on localhost, each with half of every
layer's heads and MLP width, give the logits and greedy tokens of the whole model."""
from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import decode_ok, max_diff
from gguf_factory import llama_config, random_llama, save_hf_folder
from kvlm import Batch, Context, load_model
from kvlm.parallel.shard import check_tensor_parallel, load_shard, shard_config
from test_random_models import token_ids

TOLERANCE = 1e-4
N_STEPS = 8


def prompt_then_greedy(model, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Every prompt token's logits, then N_STEPS greedy tokens one per decode."""
    ctx = Context(model, n_ctx=128, n_ubatch=16, n_seq_max=1)
    decode_ok(ctx, Batch(tokens=ids, logits=[True] * len(ids)))
    logits = torch.stack([ctx.get_logits_ith(i).clone() for i in range(len(ids))])
    generated = []
    for _ in range(N_STEPS):
        generated.append(int(ctx.get_logits_ith(-1).argmax()))
        decode_ok(ctx, Batch.for_sequence(generated[-1:]))
    return logits, generated


def _rank(rank: int, size: int, port: int, folder: str, ids: list[int], results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    try:
        logits, tokens = prompt_then_greedy(load_shard(folder, rank, size, "float32"), ids)
        results.put((rank, (logits.numpy(), tokens)))  # by value: a child's shared tensor dies with it
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """GQA 8:4 with a Qwen2-free Llama: two ranks get 4 query heads and 2 KV heads each."""
    config = llama_config(hidden_size=128, n_head=8, n_head_kv=4, n_layer=3, intermediate_size=192)
    path = tmp_path_factory.mktemp("tp-llama")
    save_hf_folder(random_llama(config, seed=3), path)
    return path


def test_two_ranks_give_the_logits_and_greedy_tokens_of_one(folder):
    ids = token_ids(1000, 40, seed=9)
    expected_logits, expected_tokens = prompt_then_greedy(load_model(str(folder), "float32"), ids)
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = mp.start_processes(_rank, args=(2, free_port(), str(folder), ids, results), nprocs=2, join=False,
                               start_method="spawn")
    # Read before joining: a child blocks until its result is read. A child that failed puts nothing: the
    # timeout ends the wait and join() then raises its traceback.
    by_rank = dict(results.get(timeout=120) for _ in range(2))
    while not ranks.join():
        pass
    for logits, tokens in by_rank.values():
        assert max_diff(torch.from_numpy(logits), expected_logits) <= TOLERANCE
        assert tokens == expected_tokens


def test_each_rank_caches_only_its_kv_heads(folder):
    config = load_model(str(folder), "float32").config
    shard = shard_config(config, 2)
    assert (shard.n_head, shard.n_head_kv, shard.n_ff) == (4, 2, 96)


def test_a_size_that_does_not_divide_the_heads_is_refused(folder):
    config = dataclasses.replace(load_model(str(folder), "float32").config, n_head=9, n_head_kv=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide n_head = 9 .*divisor of 9"):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel(config, 0)
