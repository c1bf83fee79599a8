"""Server limits and shutdown: a full server answers 429 and recovers, an oversized body is a 413, and
SIGTERM ends in-flight streams with a final error event and exits 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from petrel.serve.app import build_app
from petrel.serve.server import BackgroundServer
from tests.conftest import free_blocks

pytestmark = pytest.mark.e2e


def _stream_until_first_token(url: str, body: dict, events: list, started: threading.Event) -> None:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        events.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    started.set()


def test_full_server_answers_429_and_recovers(llm):
    app = build_app(llm)
    app.state.petrel.max_pending = 2          # as if --max-num-seqs + --max-queue-len were 2
    baseline = free_blocks(llm)
    with BackgroundServer(app) as srv:
        url = f"{srv.url}/v1/completions"
        long = {"prompt": "Count slowly:", "max_tokens": 400, "stream": True, "ignore_eos": True}
        runs = [([], threading.Event()) for _ in range(2)]
        threads = [threading.Thread(target=_stream_until_first_token, args=(url, long, ev, st), daemon=True)
                   for ev, st in runs]
        for t in threads:
            t.start()
        for _, started in runs:
            assert started.wait(60)
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "server_overloaded" and "full" in err["message"]
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        assert "petrel_request_rejected_total" in metrics and 'model_name="' in metrics
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200   # health is never refused
        llm.engine.abort_all("test over")         # the two long streams end...
        for t in threads:
            t.join(30)
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text      # ...and the server takes work again
    deadline = time.monotonic() + 10
    while free_blocks(llm) != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_blocks(llm) == baseline


def test_oversized_body_is_413(llm):
    with BackgroundServer(build_app(llm, max_request_bytes=64 * 1024)) as srv:
        big = {"prompt": "x" * 100_000, "max_tokens": 1}
        r = httpx.post(f"{srv.url}/v1/completions", json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():                              # no Content-Length: counted as it arrives
            payload = json.dumps(big).encode()
            for i in range(0, len(payload), 8192):
                yield payload[i:i + 8192]
        r = httpx.post(f"{srv.url}/v1/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_ends_streams_with_a_final_event_and_exits_0():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "petrel.cli", "serve", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            time.sleep(0.5)
        events, started = [], threading.Event()
        reader = threading.Thread(target=_stream_until_first_token, daemon=True, args=(
            f"{base}/v1/completions", {"prompt": "Tell a long story:", "max_tokens": 1000, "ignore_eos": True,
                                       "stream": True}, events, started))
        reader.start()
        assert started.wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert not reader.is_alive(), "the stream did not end after SIGTERM"
        assert events[-1] == "[DONE]"
        final = json.loads(events[-2])
        assert "shutting down" in final["error"]["message"]
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
