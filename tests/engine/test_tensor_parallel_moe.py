"""Tensor parallelism for a mixture of experts (issue 26): a random Qwen2-MoE (experts and a gated shared expert) and a
random gpt-oss (attention sinks, biases on the attention output and in the experts) on two ranks, each holding half of
every expert's width (and half of the heads), against one rank. A module of its own: one tensor-parallel
model per process at a time, and the other modules' stay up for their whole module."""
from __future__ import annotations

import pytest

from helpers.gptoss_factory import random_gpt_oss, save_gpt_oss_folder
from helpers.models import on_two_ranks, token_ids
from helpers.moe_factory import SPECS, random_moe, save_moe_folder
from helpers.tensor_parallel import VOCAB, assert_same_outputs

from kvlm import load_model
from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams


def save_model(name: str, folder):
    """The folder of the random Qwen2-MoE or of the random gpt-oss (how a GGUF file's sinks and biases are split:
    test_tensor_parallel.py)."""
    if name == "qwen2moe":
        return save_moe_folder(random_moe(SPECS["qwen2moe"]), folder)
    return save_gpt_oss_folder(random_gpt_oss(), folder)


@pytest.mark.parametrize("name", ["qwen2moe", "gpt-oss"])
def test_a_mixture_of_experts_on_two_ranks_equals_one(tmp_path_factory, name):
    """The greedy tokens equal one rank's, the logprobs within the tolerance."""
    folder = save_model(name, tmp_path_factory.mktemp("tp-moe"))
    prompts = [token_ids(VOCAB, 21, seed=7), token_ids(VOCAB, 6, seed=8), token_ids(VOCAB, 34, seed=9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = LLM(load_model(str(folder), "float32"), max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    for model in on_two_ranks(folder):
        assert_same_outputs(LLM(model, max_num_seqs=2).generate(prompts, params, use_tqdm=False), expected)
