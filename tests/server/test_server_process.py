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

KVLM = str(Path(sys.executable).with_name("kvlm"))


def start_server(gguf: Path, port: int, log_path: Path) -> subprocess.Popen:
    log = log_path.open("w")
    process = subprocess.Popen(
        [KVLM, "serve", "--model", str(gguf), "--port", str(port), "--n-ctx", "1024", "--max-num-seqs", "4",
         "--dtype", "float32", "--shutdown-timeout", "60"], stdout=log, stderr=subprocess.STDOUT)
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
