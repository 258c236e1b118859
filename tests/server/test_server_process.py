"""`kvlm serve` as a user starts it: what it logs, and a graceful stop on SIGTERM or SIGINT mid-request."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.server import free_port

from kvlm import LLM, SamplingParams

KVLM = str(Path(sys.executable).with_name("kvlm"))


def start_server(gguf: Path, port: int, log_path: Path, *options: str) -> subprocess.Popen:
    log = log_path.open("w")
    process = subprocess.Popen(
        [KVLM, "serve", "--model", str(gguf), "--port", str(port), "--n-ctx", "1024", "--max-num-seqs", "4",
         "--dtype", "float32", "--shutdown-timeout", "60", *options], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, f"no /health after 120 s:\n{log_path.read_text()}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_logs_its_setup_and_finishes_in_flight_requests_on_a_signal(smollm2_gguf_path, tmp_path, signum):
    port = free_port()
    log_path = tmp_path / "serve.log"
    process = start_server(smollm2_gguf_path, port, log_path)
    body = {"model": smollm2_gguf_path.stem, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    lines: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                lines.append(line)
                first_chunk.set()

    client = threading.Thread(target=stream)
    try:
        client.start()
        assert first_chunk.wait(60), log_path.read_text()
        process.send_signal(signum)
        client.join(timeout=120)
        assert process.wait(timeout=120) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]", lines[-5:]
    assert json.loads(data[-2])["usage"]["completion_tokens"] == 48  # the request ran to its end
    log = log_path.read_text()
    assert f"model {smollm2_gguf_path.stem}" in log
    kv_bytes = 2 * 30 * 1024 * 3 * 64 * 4  # K and V x layers x cells x KV heads x head dim x f32 bytes
    assert f"KV cache: 1024 cells x 30 layers, f32: {kv_bytes} bytes" in log
    assert f"http://127.0.0.1:{port}/v1" in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_restarted_server_reuses_the_previous_ones_conversation_from_its_disk_tier(smollm2_gguf_path, smollm2,
                                                                                    tmp_path):
    """Turn 1 to a server with --prefix-cache-dir, which then stops; turn 2 to a new server over the same directory
    takes turn 1's computed positions from disk (usage's cached_tokens) and answers as the model does uncached."""
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    body = {"model": smollm2_gguf_path.stem, "max_tokens": 24, "temperature": 0}
    answers, usages, sent = [], [], []
    for turn in range(2):
        sent.append(messages)
        port = free_port()
        log_path = tmp_path / f"serve-{turn}.log"
        process = start_server(smollm2_gguf_path, port, log_path, "--prefix-cache-dir", str(tmp_path / "tiers"))
        try:
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "messages": messages},
                               timeout=120).json()
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0, log_path.read_text()
        answers.append(reply["choices"][0]["message"]["content"])
        usages.append(reply["usage"])
        messages = messages + [{"role": "assistant", "content": answers[-1]},
                               {"role": "user", "content": "And two more?"}]
    assert f"disk {tmp_path / 'tiers'}" in log_path.read_text() and "1 entries" in log_path.read_text()
    shared = usages[0]["prompt_tokens"] + usages[0]["completion_tokens"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= 0.85 * shared
    params = SamplingParams(max_tokens=24, temperature=0.0)
    uncached = LLM(smollm2, n_ctx=1024, max_num_seqs=1, enable_prefix_caching=False)
    assert answers[1] == uncached.chat(sent[1], params, use_tqdm=False)[0].text
