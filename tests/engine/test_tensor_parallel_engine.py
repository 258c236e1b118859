"""Tensor parallelism end to end (issue 15): a model on two ranks (gloo on localhost) gives the logits and greedy
tokens of the same model on one, through Context, LLM.generate, the CLI, torchrun and the server; a rank that
dies stops everything with a clear error; sizes that do not divide the heads are refused before loading.

In this process: a random Gemma 3 (iSWA memory: a full and a sliding pool) on two ranks. In child processes: the
CLI on a random Llama."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers.gemma3_factory import random_gemma3
from helpers.gguf_factory import llama_config, random_llama, save_hf_folder
from helpers.models import decode_ok, max_diff, memory_state, on_two_ranks, token_ids
from helpers.server import free_port
from helpers.tensor_parallel import TOLERANCE, VOCAB, assert_same_outputs

from kvlm import Batch, Context, DecodeStatus, load_model
from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams
from kvlm.memory.protocol import Memory
from kvlm.loader.tensors import GGUFTensors
from kvlm.parallel import launch
from kvlm.parallel.leader import MUTATING, READS

KVLM = str(Path(sys.executable).with_name("kvlm"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """Four query heads and two KV heads: each rank gets two and one."""
    return save_hf_folder(random_gemma3(num_key_value_heads=2), tmp_path_factory.mktemp("tp-gemma3"))


@pytest.fixture(scope="module")
def one(gemma_folder):
    return load_model(str(gemma_folder), "float32")


@pytest.fixture(scope="module")
def two(gemma_folder):
    yield from on_two_ranks(gemma_folder)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    config = llama_config(hidden_size=128, n_head=8, n_head_kv=4, n_layer=3, intermediate_size=192)
    return save_hf_folder(random_llama(config, seed=3), tmp_path_factory.mktemp("tp-llama"))


# --- in this process: the Gemma 3 model on two ranks ---

def test_llm_generate_on_two_ranks_equals_one(one, two):
    """Five requests, three at a time: shared prefixes lent by the prefix cache, prompts longer than the sliding
    window (so the sliding pool frees cells as it goes), different lengths in one step."""
    shared = token_ids(VOCAB, 40, seed=1)
    prompts = [shared, shared + token_ids(VOCAB, 5, seed=2), token_ids(VOCAB, 23, seed=3),
               shared[:33] + [7, 8, 9], token_ids(VOCAB, 3, seed=4)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = LLM(one, max_num_seqs=3).generate(prompts, params, use_tqdm=False)
    llm = LLM(two, max_num_seqs=3)
    assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), expected)
    assert llm.engine.prefix_cache.hit_tokens > 0


def test_speculative_decoding_on_two_ranks_equals_one_rank_without(one, two):
    """Guesses verified on two ranks (the rejected ones' cells removed on both, by the mirrored seq_rm)."""
    prompts = [token_ids(VOCAB, 12, seed=5) * 3, token_ids(VOCAB, 9, seed=6) * 4]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = LLM(one, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    llm = LLM(two, max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in expected]
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def sequence_operations(model) -> list[torch.Tensor]:
    """Logits after each of: a prompt in micro-batches of 5, seq_cp + partial seq_rm + continuation, a context
    shift (keep 4, discard 6), a batch aborted after its first micro-batch and then run again, a saved sequence
    loaded into another id, a batch whose first micro-batch outputs nothing."""
    ids = token_ids(VOCAB, 60, seed=5)
    ctx = Context(model, n_ctx=128, n_batch=64, n_ubatch=5, n_seq_max=3, swa_full=True)
    logits = []

    def run(batch: Batch) -> None:
        decode_ok(ctx, batch)
        logits.append(torch.stack([ctx.get_logits_ith(i).clone() for i in range(sum(batch.logits))]))

    run(Batch(tokens=ids[:20], logits=[True] * 20))
    ctx.memory.seq_cp(0, 1, -1, -1)
    assert ctx.memory.seq_rm(1, 15, -1)
    run(Batch(tokens=ids[30:35], pos=list(range(15, 20)), seq_ids=[1] * 5, logits=[True] * 5))
    assert ctx.memory.seq_rm(0, 4, 10)
    ctx.memory.seq_add(0, 10, -1, -6)
    run(Batch(tokens=[ids[40]], pos=[14], seq_ids=[0], logits=[True]))
    calls = iter([False, True])
    ctx.abort_callback = lambda: next(calls)
    before = memory_state(ctx, range(3))
    assert ctx.decode(Batch(tokens=ids[41:49], pos=list(range(15, 23)), seq_ids=[0] * 8)) == DecodeStatus.ABORTED
    assert memory_state(ctx, range(3)) == before
    ctx.abort_callback = None
    run(Batch(tokens=ids[41:49], pos=list(range(15, 23)), seq_ids=[0] * 8, logits=[True] * 8))
    ctx.state_seq_load(ctx.state_seq_save(0), 2)
    run(Batch(tokens=[ids[50]], pos=[23], seq_ids=[2], logits=[True]))
    run(Batch(tokens=ids[51:59], pos=list(range(24, 32)), seq_ids=[2] * 8, logits=[False] * 7 + [True]))
    return logits


def test_sequence_operations_roll_back_and_saved_state_agree_across_ranks(one, two):
    for ours, expected in zip(sequence_operations(two), sequence_operations(one), strict=True):
        assert max_diff(ours, expected) <= TOLERANCE
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_a_state_saved_by_one_rank_is_refused_by_two_and_nothing_changes(one, two):
    saved = Context(one, n_ctx=64, n_seq_max=2)
    decode_ok(saved, Batch.for_sequence(token_ids(VOCAB, 12, seed=6)))
    ctx = Context(two, n_ctx=64, n_seq_max=2)
    decode_ok(ctx, Batch.for_sequence(token_ids(VOCAB, 9, seed=7)))
    before = memory_state(ctx, range(2))
    with pytest.raises(ValueError, match="not saved by a tensor-parallel model; this one has 2 ranks"):
        ctx.state_seq_load(saved.state_seq_save(0), 1)
    assert memory_state(ctx, range(2)) == before


def test_each_rank_caches_only_its_kv_heads(one, two):
    assert two.config.n_head_kv == one.config.n_head_kv // 2
    ours, theirs = Context(two, n_ctx=64).memory, Context(one, n_ctx=64).memory
    assert ours.kind == theirs.kind == "iswa"
    assert ours.kv_bytes * 2 == theirs.kv_bytes


# --- refused before anything is loaded ---

def test_a_size_that_does_not_divide_the_heads_is_refused_before_loading(smollm2_gguf_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("refused too late: a process was started or weights were read")

    monkeypatch.setattr(launch, "start_local_group", never)
    monkeypatch.setattr(GGUFTensors, "read", never)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide n_head = 9, n_head_kv = 3 .*"
                                         r"sizes that work: 1, 3"):
        load_model(str(smollm2_gguf_path), "float32", tensor_parallel_size=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 0}, "must be a positive integer, got 0"),
    ({"tensor_parallel_size": 2, "compile": True}, "compile and tensor parallelism exclude each other"),
])
def test_bad_tensor_parallel_arguments_are_refused(llama_folder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_model(str(llama_folder), "float32", **kwargs)


def test_llm_refuses_a_size_for_a_model_it_did_not_load(one):
    with pytest.raises(ValueError, match="pass it to load_model"):
        LLM(one, tensor_parallel_size=2)


# --- child processes: the CLI, torchrun, the server, a killed worker ---

def expected_greedy(folder: Path, prompt: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return LLM(load_model(str(folder), "float32"), max_num_seqs=1).generate(prompt, params, use_tqdm=False)[0].token_ids


GENERATE = ["generate", "--prompt", "Once upon a time", "--max-tokens", "12", "--ignore-eos", "--dtype", "float32",
            "--json", "-tp", "2"]


@pytest.mark.parametrize("launcher", [[KVLM], [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--no-python", KVLM]],
                         ids=["kvlm", "torchrun"])
def test_cli_generate_on_two_ranks_equals_one(llama_folder, launcher):
    done = subprocess.run([*launcher, *GENERATE, "--model", str(llama_folder)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == expected_greedy(llama_folder, "Once upon a time", 12)


def children(pid: int) -> list[int]:
    """Every living descendant of a process (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def worker_pid(pid: int) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in children(pid):
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError("no worker process appeared")


def assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"left behind: {[p for p in pids if Path(f'/proc/{p}').exists()]}"
        time.sleep(0.1)


# A hung worker is noticed by whichever waits first: a collective's own timeout ("timed out after 3 s") or the
# watch thread ("sending a step took more than 3 s").
@pytest.mark.parametrize("signum, fate", [(signal.SIGKILL, r"was killed by SIGKILL"),
                                           (signal.SIGSTOP, r"is running but did not answer; .*(timed out after|"
                                                            r"took more than) 3 s")], ids=["killed", "hung"])
def test_a_worker_killed_or_hung_mid_generation_ends_the_command_with_an_error(llama_folder, signum, fate):
    process = subprocess.Popen([KVLM, "generate", "--model", str(llama_folder), "--prompt", "Once", "--max-tokens",
                                "4000", "--ignore-eos", "--n-ctx", "4096", "--dtype", "float32", "-tp", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "KVLM_TP_TIMEOUT": "3"})
    try:
        process.stdout.read(5)  # generation has started
        descendants = children(process.pid)
        os.kill(worker_pid(process.pid), signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 1
    assert "tensor parallelism stopped (2 ranks): rank 1 (pid" in stderr and re.search(fate, stderr), stderr
    assert_all_gone(descendants)


def complete(base: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_server_on_two_ranks_answers_as_one_and_stops_when_a_worker_dies(llama_folder, tmp_path):
    port, log_path = free_port(), tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([KVLM, "serve", "--model", str(llama_folder), "--port", str(port), "--dtype",
                                    "float32", "--n-ctx", "512", "--max-num-seqs", "4", "--served-model-name", "m",
                                    "-tp", "2"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _healthy(base):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        prompts = ["Once upon a time", "The river", "Once upon a time there"]
        answers = {}
        threads = [threading.Thread(target=lambda p=p: answers.update({p: complete(base, p, 10)})) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
        expected = LLM(load_model(str(llama_folder), "float32")).generate(prompts, params, use_tqdm=False)
        for prompt, output in zip(prompts, expected):
            logprobs = answers[prompt]["logprobs"]["token_logprobs"]
            assert answers[prompt]["text"] == output.text
            assert max(abs(a - b.logprob) for a, b in zip(logprobs, output.logprobs, strict=True)) <= TOLERANCE
        descendants = children(process.pid)
        os.kill(worker_pid(process.pid), signal.SIGKILL)
        assert process.wait(timeout=60) == 1
    finally:
        process.kill()
    text = log_path.read_text()
    assert "the server stopped: tensor parallelism stopped (2 ranks): rank 1" in text and "SIGKILL" in text
    assert_all_gone(descendants)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_using_a_stopped_model_raises(llama_folder):
    """After stop() (or a failure), using the model fails at once (here: making its context) instead of waiting on
    a dead group."""
    done = subprocess.run([sys.executable, "-c", STOPPED_SCRIPT, str(llama_folder)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "TensorParallelError: the tensor-parallel model was stopped"


STOPPED_SCRIPT = """
import sys
from kvlm import load_model
from kvlm.engine.llm import LLM
from kvlm.sampling.params import SamplingParams
if __name__ == "__main__":
    model = load_model(sys.argv[1], "float32", tensor_parallel_size=2)
    model.tensor_parallel.stop()
    try:
        LLM(model).generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
"""


def test_every_memory_call_is_either_repeated_on_the_other_ranks_or_only_reads():
    """A call added to the memory protocol must be classified, or the ranks' memories could silently drift."""
    calls = {name for name in [*vars(Memory), *Memory.__annotations__] if not name.startswith("_")}
    assert calls == MUTATING | READS | {"state_seq_save", "state_seq_load"}
    assert not MUTATING & READS
