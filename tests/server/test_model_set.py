"""Several models in one server (kvlm.server.model_set): each loaded at its first request (or at start with
preload), at most max_loaded at once, a server-wide memory budget shared by the loaded models (an idle one
unloaded to make room, a 503 naming the sizes when none is idle), idle models unloaded after idle_unload seconds,
/v1/models telling each model's state; `kvlm serve`'s repeated --model and --served-model-name.

Two tiny random-weight GGUF models (qwen2 and Llama 3 specs) are served through the real app on a live uvicorn;
every greedy output is compared with what that model's own Engine gives alone."""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

import kvlm.server.model_set as model_set_module
import kvlm.server.serve as serve_module
from helpers.family_factory import SPECS, random_model, save_model
from helpers.server import serving
from kvlm.cli import commands
from kvlm.engine.engine import Engine, memory_request
from kvlm.loader.load import load_model
from kvlm.loader.memory_plan import _mib
from kvlm.sampling.params import SamplingParams
from kvlm.server.app import create_app
from kvlm.server.model_set import ModelSet
from kvlm.server.serve import ServeSettings, served_name

pytestmark = pytest.mark.usefixtures("one_thread")

N_CTX, SEQS = 128, 2
PROMPT = "Hello there"
FAMILIES = {"a": "qwen2", "b": "llama-llama3"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Served name -> a GGUF file of its own random model."""
    out = {}
    for name, family in FAMILIES.items():
        spec = SPECS[family]
        out[name] = str(save_model(random_model(spec), spec, "gguf", tmp_path_factory.mktemp(f"model-{name}")))
    return out


@pytest.fixture(scope="module")
def alone(paths):
    """alone(name, max_tokens): the text that model's own Engine generates greedily for PROMPT (EOS ignored)."""
    engines = {name: Engine(load_model(path, "float32", progress=False), n_ctx=N_CTX, max_num_seqs=SEQS)
               for name, path in paths.items()}
    cache: dict[tuple[str, int], str] = {}

    def text(name: str, max_tokens: int = 8) -> str:
        if (name, max_tokens) not in cache:
            engine = engines[name]
            ids = engine.model.tokenizer.encode(PROMPT)
            request_id = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            output = engine.release(request_id)
            assert len(output.token_ids) == max_tokens
            cache[name, max_tokens] = output.text
        return cache[name, max_tokens]

    assert text("a") != text("b")  # so that a request served by the wrong model shows
    return text


@pytest.fixture(scope="module")
def totals(paths) -> dict[str, int]:
    """Each model's planned bytes (weights + KV cache + buffers) as the server's engines plan them."""
    return {name: Build()(name, path, None).plan.total for name, path in paths.items()}


class Build:
    """ModelSet's `build`, as `kvlm serve` builds an engine: every call recorded as (name, budget); a name in
    `gates` waits for its event before loading."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.gates: dict[str, threading.Event] = {}

    def __call__(self, name: str, source: str, budget: int | None) -> Engine:
        self.calls.append((name, budget))
        if name in self.gates:
            assert self.gates[name].wait(60)
        model = load_model(source, "float32", progress=False, memory=memory_request(N_CTX, SEQS),
                           memory_budget=budget)
        return Engine(model, n_ctx=N_CTX, max_num_seqs=SEQS, memory_budget=budget)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def no_grace(monkeypatch):
    """A model just used is idle at once (not IDLE_GRACE_S later)."""
    monkeypatch.setattr(model_set_module, "IDLE_GRACE_S", 0.0)


@pytest.fixture
def slow_steps(monkeypatch):
    """Every engine step takes 20 ms more: a request of 100 tokens stays in flight for 2 s at least."""
    step = Engine.step

    def slow(self):
        time.sleep(0.02)
        return step(self)

    monkeypatch.setattr(Engine, "step", slow)


def model_set(paths, build: Build, **options) -> ModelSet:
    return ModelSet([("a", paths["a"]), ("b", paths["b"])], build, **options)


@contextmanager
def live(models, preload: bool = False):
    """(openai client, httpx client) of a live server of `models`."""
    with serving(create_app(models, preload=preload)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        with httpx.Client(base_url=url, timeout=120) as http:
            yield client, http


def complete(client, model: str, max_tokens: int = 8) -> str:
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.model == model and response.usage.completion_tokens == max_tokens
    return response.choices[0].text


def listed(http) -> dict[str, dict]:
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    return {item["id"]: item for item in body["data"]}


def states(http) -> dict[str, str]:
    return {name: item["status"] for name, item in listed(http).items()}


def wait_for(condition, timeout: float = 10.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def refusal(excinfo) -> str:
    """The message of an error response, checked to be OpenAI's shape."""
    error = excinfo.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error["message"]


# --- two models in one server ---

def test_each_model_loads_at_its_first_request_and_answers_as_its_own_engine(paths, alone):
    build = Build()
    with live(model_set(paths, build)) as (client, http):
        models = listed(http)
        assert list(models) == ["a", "b"]
        for item in models.values():
            assert item["status"] == "unloaded" and "max_model_len" not in item
            assert item["object"] == "model" and item["owned_by"] == "kvlm"
        assert build.calls == []
        assert http.get("/metrics", params={"model": "a"}).text == ""  # nothing while it is not loaded

        assert complete(client, "a") == alone("a")
        assert build.names == ["a"]
        models = listed(http)
        assert models["a"]["status"] == "loaded" and models["a"]["max_model_len"] == N_CTX
        assert models["b"]["status"] == "unloaded" and "max_model_len" not in models["b"]

        assert complete(client, "b") == alone("b")
        assert build.names == ["a", "b"]
        assert states(http) == {"a": "loaded", "b": "loaded"}
        assert listed(http)["b"]["max_model_len"] == N_CTX

        # the same models again: nothing loads twice, the outputs stay
        assert complete(client, "a") == alone("a") and complete(client, "b") == alone("b")
        assert build.names == ["a", "b"]

        # a request without a model goes to the first
        response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "a" and response.json()["choices"][0]["text"] == alone("a")

        # each model's own metrics: a finished three requests, b two
        def finished(model: str) -> str:
            text = http.get("/metrics", params={"model": model}).text
            return next(line for line in text.splitlines() if line.startswith("kvlm_requests_total{"))
        assert finished("a").endswith(" 3.0") and finished("b").endswith(" 2.0")
        assert http.get("/kv", params={"model": "b"}).status_code == 200


def test_an_unknown_model_is_a_404_naming_the_served_ones(paths, alone):
    build = Build()
    with live(model_set(paths, build)) as (client, http):
        with pytest.raises(openai.NotFoundError) as excinfo:
            complete(client, "c")
        message = refusal(excinfo)
        assert "'c'" in message and "'a', 'b'" in message
        assert excinfo.value.response.json()["error"]["code"] == "model_not_found"
        for path in ("/metrics", "/kv"):
            response = http.get(path, params={"model": "c"})
            assert response.status_code == 404 and "'a', 'b'" in response.json()["error"]["message"]
        assert build.calls == [] and states(http) == {"a": "unloaded", "b": "unloaded"}
        assert complete(client, "b") == alone("b")  # the server still serves


def test_a_model_loading_is_listed_as_loading_and_its_requests_wait_for_it(paths, alone):
    build = Build()
    build.gates["a"] = gate = threading.Event()
    with live(model_set(paths, build)) as (client, http):
        results: dict[str, str] = {}
        requests = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(client, "a")))
                    for i in range(2)]
        for thread in requests:
            thread.start()
        wait_for(lambda: states(http) == {"a": "loading", "b": "unloaded"})
        assert "max_model_len" not in listed(http)["a"]
        # models load one at a time: a request for b waits for a's load
        requests.append(threading.Thread(target=lambda: results.__setitem__("b", complete(client, "b"))))
        requests[-1].start()
        time.sleep(0.3)
        assert requests[-1].is_alive() and results == {} and build.names == ["a"]
        assert states(http) == {"a": "loading", "b": "unloaded"}
        gate.set()
        for thread in requests:
            thread.join(60)
        assert results == {0: alone("a"), 1: alone("a"), "b": alone("b")}
        assert build.names == ["a", "b"]  # both requests for a waited for its one load
        assert states(http) == {"a": "loaded", "b": "loaded"}


# --- max_loaded ---

def test_max_loaded_unloads_the_least_recently_used_idle_model(paths, alone, no_grace):
    build = Build()
    with live(model_set(paths, build, max_loaded=1)) as (client, http):
        assert complete(client, "a") == alone("a")
        assert states(http) == {"a": "loaded", "b": "unloaded"}
        assert complete(client, "b") == alone("b")
        assert states(http) == {"a": "unloaded", "b": "loaded"}
        assert "max_model_len" not in listed(http)["a"]
        assert complete(client, "a") == alone("a")
        assert states(http) == {"a": "loaded", "b": "unloaded"}
        assert build.names == ["a", "b", "a"]


def test_max_loaded_refuses_while_the_loaded_model_was_just_used(paths, alone, monkeypatch):
    monkeypatch.setattr(model_set_module, "IDLE_GRACE_S", 1.0)
    build = Build()
    with live(model_set(paths, build, max_loaded=1)) as (client, http):
        assert complete(client, "a") == alone("a")
        with pytest.raises(openai.InternalServerError) as excinfo:  # a was asked for less than 1 s ago
            complete(client, "b")
        assert excinfo.value.status_code == 503
        message = refusal(excinfo)
        assert "'b'" in message and "--max-loaded-models" in message
        assert states(http) == {"a": "loaded", "b": "unloaded"}
        time.sleep(1.1)
        assert complete(client, "b") == alone("b")
        assert states(http) == {"a": "unloaded", "b": "loaded"}


def test_max_loaded_refuses_while_the_loaded_model_has_a_request_in_flight(paths, alone, no_grace, slow_steps):
    build = Build()
    with live(model_set(paths, build, max_loaded=1)) as (client, http):
        stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text  # a is generating
        with pytest.raises(openai.InternalServerError) as excinfo:
            complete(client, "b")
        assert excinfo.value.status_code == 503 and "--max-loaded-models" in refusal(excinfo)
        assert states(http) == {"a": "loaded", "b": "unloaded"}
        text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert text == alone("a", 60)  # the request in flight was not disturbed
        assert complete(client, "b") == alone("b")  # a is idle now
        assert states(http) == {"a": "unloaded", "b": "loaded"}


# --- idle_unload ---

def test_idle_models_unload_and_load_again_at_their_next_request(paths, alone, no_grace):
    build = Build()
    with live(model_set(paths, build, idle_unload=0.5)) as (client, http):
        assert complete(client, "a") == alone("a")
        done = time.monotonic()
        wait_for(lambda: states(http)["a"] == "unloaded", timeout=5)
        assert time.monotonic() - done < 5
        assert "max_model_len" not in listed(http)["a"]
        assert complete(client, "a") == alone("a")
        assert build.names == ["a", "a"]
        wait_for(lambda: states(http) == {"a": "unloaded", "b": "unloaded"}, timeout=5)


def test_idle_unload_counts_from_the_end_of_the_last_request(paths, alone, no_grace, slow_steps):
    """--idle-unload S: a model no request used for S seconds; one whose request ended just now was used just now,
    however long ago that request arrived."""
    build = Build()
    expected = alone("a", 100)  # (first: its steps are slowed too)
    with live(model_set(paths, build, idle_unload=1.0)) as (client, http):
        started = time.monotonic()
        assert complete(client, "a", max_tokens=100) == expected  # in flight for 2 s and more
        ended = time.monotonic()
        assert ended - started > 1.5
        time.sleep(0.5)  # half the idle time since the request ended
        assert states(http)["a"] == "loaded", "unloaded 0.5 s after its request ended, with --idle-unload 1"
        wait_for(lambda: states(http)["a"] == "unloaded", timeout=5)


# --- the memory budget ---

def test_a_model_that_does_not_fit_beside_an_idle_one_unloads_it(paths, alone, totals, no_grace):
    budget = int(1.5 * max(totals.values()))  # room for one model, not two
    build = Build()
    with live(model_set(paths, build, memory_budget=budget)) as (client, http):
        assert complete(client, "a") == alone("a")
        assert complete(client, "b") == alone("b")
        assert states(http) == {"a": "unloaded", "b": "loaded"}
        # b planned in what a left, refused, then planned in the whole budget once a was unloaded
        assert build.calls == [("a", budget), ("b", budget - totals["a"]), ("b", budget)]
        assert complete(client, "a") == alone("a")
        assert states(http) == {"a": "loaded", "b": "unloaded"}


def test_a_model_that_does_not_fit_beside_a_busy_one_is_refused_with_the_sizes(paths, alone, totals, no_grace,
                                                                               slow_steps):
    budget = int(1.5 * max(totals.values()))
    build = Build()
    with live(model_set(paths, build, memory_budget=budget)) as (client, http):
        stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        with pytest.raises(openai.InternalServerError) as excinfo:
            complete(client, "b")
        assert excinfo.value.status_code == 503
        message = refusal(excinfo)
        assert "'b'" in message and "beside the loaded ones (a)" in message
        assert f"= {_mib(totals['b'])}" in message and f"the memory budget is {_mib(budget - totals['a'])}" in message
        assert "weights" in message and "KV cache" in message
        assert states(http) == {"a": "loaded", "b": "unloaded"}
        text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert text == alone("a", 60)
        assert complete(client, "a") == alone("a")  # the server still serves the first
        assert build.names == ["a", "b"]


def test_a_budget_smaller_than_any_model_refuses_the_first_request(paths, alone, totals):
    budget = min(totals.values()) // 2
    build = Build()
    with live(model_set(paths, build, memory_budget=budget)) as (client, http):
        for _ in range(2):  # refused each time, the lock not held by the failed load
            with pytest.raises(openai.InternalServerError) as excinfo:
                complete(client, "a")
            assert excinfo.value.status_code == 503
            message = refusal(excinfo)
            assert "'a'" in message and "(none)" in message and f"= {_mib(totals['a'])}" in message
        assert states(http) == {"a": "unloaded", "b": "unloaded"}
        assert build.calls == [("a", budget), ("a", budget)]


# --- preload ---

def test_preload_loads_every_model_at_start(paths, alone):
    build = Build()
    with live(model_set(paths, build), preload=True) as (client, http):
        assert build.names == ["a", "b"]
        models = listed(http)
        assert {name: item["status"] for name, item in models.items()} == {"a": "loaded", "b": "loaded"}
        assert models["a"]["max_model_len"] == models["b"]["max_model_len"] == N_CTX
        assert complete(client, "b") == alone("b") and complete(client, "a") == alone("a")
        assert build.names == ["a", "b"]


# --- requests to two models at once ---

def test_requests_to_two_models_at_once_each_get_their_models_output(paths, alone):
    build = Build()
    with live(model_set(paths, build)) as (client, http):
        base_url = str(client.base_url)

        async def both() -> list[str]:
            async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as aclient:
                async def one(model: str) -> str:
                    response = await aclient.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                                                temperature=0, extra_body={"ignore_eos": True})
                    assert response.model == model
                    return response.choices[0].text

                return await asyncio.gather(*(one(model) for model in ("a", "b", "b", "a")))

        assert asyncio.run(both()) == [alone("a"), alone("b"), alone("b"), alone("a")]
        assert sorted(build.names) == ["a", "b"]
        assert states(http) == {"a": "loaded", "b": "loaded"}


# --- settings and the command line ---

def test_served_names_default_from_the_sources(tmp_path):
    folder = tmp_path / "my-hf-model"
    folder.mkdir()
    assert served_name("/models/qwen-0.5b-q8_0.gguf") == "qwen-0.5b-q8_0"
    assert served_name("/models/big-00001-of-00003.gguf") == "big"
    assert served_name(str(folder)) == "my-hf-model"
    assert served_name("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    settings = ServeSettings(model=["/models/qwen-0.5b-q8_0.gguf", str(folder)])
    assert settings.named_models() == [("qwen-0.5b-q8_0", "/models/qwen-0.5b-q8_0.gguf"), ("my-hf-model", str(folder))]
    assert ServeSettings(model="/m/one.gguf").named_models() == [("one", "/m/one.gguf")]


def test_served_model_names_are_given_once_per_model():
    settings = ServeSettings(model=["/m/x.gguf", "/m/y.gguf"], served_model_name=["first", "second"])
    assert settings.named_models() == [("first", "/m/x.gguf"), ("second", "/m/y.gguf")]
    assert ServeSettings(model="/m/x.gguf", served_model_name="mine").named_models() == [("mine", "/m/x.gguf")]
    for names in (["only"], "only", ["a", "b", "c"]):
        with pytest.raises(ValueError) as excinfo:
            ServeSettings(model=["/m/x.gguf", "/m/y.gguf"], served_model_name=names).named_models()
        given = 1 if isinstance(names, str) else len(names)
        assert f"given {given} times for 2 models" in str(excinfo.value)


def test_model_set_refuses_two_models_of_one_name_and_max_loaded_below_one(paths):
    same = ServeSettings(model=[paths["a"], paths["b"]]).named_models()  # both files are model.gguf
    assert [name for name, _ in same] == ["model", "model"]
    with pytest.raises(ValueError, match="two models are served as 'model'"):
        ModelSet(same, Build())
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"at least 1, got {bad}"):
            model_set(paths, Build(), max_loaded=bad)
    assert model_set(paths, Build(), max_loaded=1).max_loaded == 1


def test_the_command_line_takes_repeated_models_and_names():
    args = commands._parser().parse_args([
        "serve", "--model", "A", "--model", "B", "--served-model-name", "a", "--served-model-name", "b",
        "--preload", "--idle-unload", "30", "--max-loaded-models", "1", "--pooling", "mean",
        "--scheduling-policy", "priority"])
    assert args.model == ["A", "B"] and args.served_model_name == ["a", "b"]
    assert args.preload is True and args.idle_unload == 30.0 and args.max_loaded_models == 1
    assert args.pooling == "mean" and args.scheduling_policy == "priority"
    defaults = commands._parser().parse_args(["serve"])
    assert defaults.model is None and defaults.served_model_name is None
    assert not defaults.preload and defaults.idle_unload is None and defaults.max_loaded_models is None
    assert defaults.scheduling_policy == "fcfs"


class FakeServer:
    """uvicorn.Server for serve(): run() records each model's state instead of serving."""

    seen: list[FakeServer] = []

    def __init__(self, config) -> None:
        self.config = config
        self.should_exit = False
        FakeServer.seen.append(self)

    def run(self) -> None:
        self.models = self.config.app.state.models
        self.states = {name: entry.state for name, entry in self.models.entries.items()}


@pytest.fixture
def fake_uvicorn(monkeypatch) -> list[FakeServer]:
    FakeServer.seen = []
    monkeypatch.setattr(serve_module.uvicorn, "Server", FakeServer)
    monkeypatch.setattr(serve_module.signal, "signal", lambda *args: None)
    return FakeServer.seen


def serve_args(paths, *extra: str) -> list[str]:
    return ["serve", "--model", paths["a"], "--model", paths["b"], "--served-model-name", "a",
            "--served-model-name", "b", "--dtype", "float32", "--n-ctx", str(N_CTX), "--max-num-seqs", str(SEQS),
            "--device", "cpu", *extra]


def test_kvlm_serve_with_two_models_loads_them_at_first_use_or_with_preload(paths, fake_uvicorn):
    assert commands.main(serve_args(paths, "--idle-unload", "30", "--max-loaded-models", "2")) == 0
    (server,) = fake_uvicorn
    assert server.states == {"a": "unloaded", "b": "unloaded"}
    assert server.models.idle_unload == 30.0 and server.models.max_loaded == 2

    assert commands.main(serve_args(paths, "--preload")) == 0
    assert fake_uvicorn[1].states == {"a": "loaded", "b": "loaded"}
    assert [e.served.engine.n_ctx for e in fake_uvicorn[1].models.loaded] == [N_CTX, N_CTX]

    assert commands.main(["serve", "--model", paths["a"], "--dtype", "float32", "--n-ctx", str(N_CTX),
                          "--device", "cpu"]) == 0
    assert fake_uvicorn[2].states == {"model": "loaded"}  # one model loads at once, named from its file


def test_kvlm_serve_refuses_a_name_count_that_does_not_match(paths, fake_uvicorn, capsys):
    assert commands.main(["serve", "--model", paths["a"], "--model", paths["b"], "--served-model-name", "a"]) == 1
    assert "given 1 times for 2 models" in capsys.readouterr().err
    assert fake_uvicorn == []


def test_kvlm_serve_preload_keeps_to_max_loaded_models(paths, fake_uvicorn, capsys):
    """--max-loaded-models N: never more than N loaded, --preload or not (refused as a contradiction, or at most N
    loaded)."""
    if commands.main(serve_args(paths, "--preload", "--max-loaded-models", "1")) != 0:
        assert "max-loaded-models" in capsys.readouterr().err and fake_uvicorn == []
        return
    loaded = [name for name, state in fake_uvicorn[0].states.items() if state == "loaded"]
    assert len(loaded) <= 1, f"--preload --max-loaded-models 1 loaded {loaded}"


def test_a_model_that_cannot_be_loaded_is_a_503_and_the_others_serve_on(paths, alone, tmp_path):
    missing = str(tmp_path / "missing.gguf")
    build = Build()
    with live(ModelSet([("a", paths["a"]), ("gone", missing)], build)) as (client, http):
        with pytest.raises(openai.InternalServerError) as caught:
            complete(client, "gone")
        assert caught.value.status_code == 503 and "'gone' could not be loaded" in caught.value.body["message"]
        assert complete(client, "a") == alone("a")
        assert states(http) == {"a": "loaded", "gone": "unloaded"}
        # /kv shows a loaded model's cache, and loads nothing (it is open without the API key)
        assert http.get("/kv", params={"model": "a"}).status_code == 200
        assert http.get("/kv", params={"model": "gone"}).status_code == 409


def test_idle_unload_must_be_positive_and_tensor_parallelism_serves_one_model_for_good(paths):
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=f"idle_unload must be a positive number of seconds, got {bad}"):
            ModelSet([("a", paths["a"])], Build(), idle_unload=bad)
    from kvlm.server.serve import ServeSettings, serve

    for extra in ({"model": [paths["a"], paths["b"]]}, {"model": paths["a"], "idle_unload": 5.0},
                  {"model": paths["a"], "max_loaded_models": 1}):
        with pytest.raises(ValueError, match="tensor parallelism serves one model"):
            serve(ServeSettings(tensor_parallel_size=2, **extra))
