"""The priority scheduling policy (vLLM's --scheduling-policy priority): requests wait, are admitted and are
preempted in the order of their priority (lower first), then of arrival; a waiting request that outranks a running
one takes its sequence. Greedy outputs stay what each request gives alone (a preempted request is recomputed)."""
from __future__ import annotations

import pytest

from helpers.family_factory import SPECS, random_model, save_model
from helpers.models import token_ids
from kvlm.engine.engine import Engine
from kvlm.loader.load import load_model
from kvlm.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    spec = SPECS["qwen2"]
    path = save_model(random_model(spec), spec, "gguf", tmp_path_factory.mktemp("priority"))
    return load_model(str(path), "float32", progress=False)


def alone(model, ids: list[int]) -> list[int]:
    engine = Engine(model, n_ctx=256, max_num_seqs=1)
    request_id = engine.add_request(ids, GREEDY)
    while engine.has_unfinished():
        engine.step()
    return engine.release(request_id).token_ids


def run(engine: Engine, order: list[str]) -> None:
    while engine.has_unfinished():
        for event in engine.step():
            if event.finished:
                order.append(event.request_id)


def test_a_waiting_request_that_outranks_a_running_one_preempts_it(model):
    prompts = {name: token_ids(model.config.vocab_size, 9, seed=i) for i, name in enumerate(("low", "high"))}
    engine = Engine(model, n_ctx=256, max_num_seqs=1, scheduling_policy="priority")
    engine.add_request(prompts["low"], GREEDY, "low", priority=5)
    order: list[str] = []
    for _ in range(4):  # the low-priority request is decoding
        engine.step()
    assert engine.requests["low"].output_token_ids
    engine.add_request(prompts["high"], GREEDY, "high", priority=-1)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["high"]
    run(engine, order)
    assert order == ["high", "low"] and engine.requests["low"].n_preemptions == 1
    for name, ids in prompts.items():
        assert engine.release(name).token_ids == alone(model, ids)


def test_waiting_requests_start_in_priority_then_arrival_order(model):
    engine = Engine(model, n_ctx=256, max_num_seqs=1, scheduling_policy="priority")
    for name, priority in (("a", 3), ("b", 1), ("c", 3), ("d", 0), ("e", 1)):
        engine.add_request(token_ids(model.config.vocab_size, 5, seed=ord(name)), GREEDY, name, priority=priority)
    order: list[str] = []
    run(engine, order)
    assert order == ["d", "b", "e", "a", "c"]
    assert all(engine.requests[name].n_preemptions == 0 for name in order)  # equal or lower ranks never preempt


def test_equal_priorities_run_first_come_first_served(model):
    engine = Engine(model, n_ctx=256, max_num_seqs=1, scheduling_policy="priority")
    for name in "xyz":
        engine.add_request(token_ids(model.config.vocab_size, 5, seed=ord(name)), GREEDY, name, priority=2)
    order: list[str] = []
    run(engine, order)
    assert order == list("xyz")


def test_priority_needs_the_priority_policy(model):
    engine = Engine(model, n_ctx=256, max_num_seqs=1)
    with pytest.raises(ValueError, match="priority 3 needs the priority scheduling policy"):
        engine.add_request([1, 2, 3], GREEDY, "x", priority=3)
    assert "x" not in engine.requests and not engine.has_unfinished()
    with pytest.raises(ValueError, match="must be one of fcfs, priority, got 'lifo'"):
        Engine(model, n_ctx=256, scheduling_policy="lifo")


def test_llm_generate_takes_a_priority_per_prompt(model):
    from kvlm.engine.llm import LLM

    llm = LLM(model, n_ctx=256, max_num_seqs=1, scheduling_policy="priority")
    prompts = [token_ids(model.config.vocab_size, 6, seed=s) for s in range(3)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert [o.token_ids for o in outputs] == [alone(model, ids) for ids in prompts]
    assert sorted(range(3), key=lambda i: outputs[i].time_to_first_token) == [1, 2, 0]
    with pytest.raises(ValueError, match="priority has 2 values for 3 prompts"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="needs the priority scheduling policy"):
        LLM(model, n_ctx=256).generate(prompts, GREEDY, use_tqdm=False, priority=[0, 1, 2])


@pytest.mark.server
def test_the_servers_priority_field_orders_requests_under_load(model, monkeypatch):
    """Through the HTTP API: with one sequence, a high-priority request sent while a low one decodes finishes
    first; under first come, first served a priority is a 400 naming the field."""
    import threading
    import time

    step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: time.sleep(0.01) or step(self))  # the low one decodes >= 0.6 s

    import openai

    from helpers.server import serving
    from kvlm.server.app import create_app

    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ids = token_ids(model.config.vocab_size, 6, seed=9)
    with serving(create_app(Engine(model, n_ctx=256, max_num_seqs=1, scheduling_policy="priority"), "m")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        finished: list[str] = []
        low = client.completions.create(model="m", prompt=ids, max_tokens=long.max_tokens, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True, "priority": 10})
        chunks = iter(low)
        next(chunks)  # the low-priority request is decoding

        def high() -> None:
            client.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True, "priority": -5})
            finished.append("high")

        thread = threading.Thread(target=high)
        thread.start()
        for _ in chunks:
            pass
        finished.append("low")
        thread.join()
        assert finished == ["high", "low"]
    with serving(create_app(Engine(model, n_ctx=256, max_num_seqs=1), "m")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="m", prompt=ids, max_tokens=2, extra_body={"priority": 1})
        assert caught.value.body["param"] == "priority" and "priority scheduling policy" in caught.value.body["message"]
        assert client.completions.create(model="m", prompt=ids, max_tokens=2).choices[0].text is not None


def test_the_token_budget_goes_to_the_higher_priority_prompt_first(model):
    """Both running: a later, higher-priority prompt is chunked before an earlier, lower one."""
    engine = Engine(model, n_ctx=256, max_num_seqs=2, max_num_batched_tokens=16, scheduling_policy="priority")
    engine.add_request(token_ids(model.config.vocab_size, 100, seed=1), GREEDY, "low", priority=3)
    engine.step()
    engine.add_request(token_ids(model.config.vocab_size, 40, seed=2), GREEDY, "high", priority=1)
    engine.step()
    assert (engine.requests["high"].n_computed, engine.requests["low"].n_computed) == (16, 16)
    engine.step()
    assert (engine.requests["high"].n_computed, engine.requests["low"].n_computed) == (32, 16)
