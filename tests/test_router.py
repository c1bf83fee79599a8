"""`petrel route` over two real `petrel serve` processes on loopback (the default model): requests spread over
both, a shared prefix sticks to one backend and hits its prefix cache, target_endpoint picks a backend,
streams pass through, and killing a backend loses no request that had not started streaming."""
from __future__ import annotations

import asyncio
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petrel.bench_serve import _free_port, start_server
from petrel.route import Router, build_router_app
from petrel.serve.errors import APIError
from petrel.serve.server import BackgroundServer

MODEL = "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------------ choosing a backend
def test_a_prefix_always_prefers_the_same_backend_and_prefixes_spread():
    router = Router(["http://a", "http://b", "http://c"], prefix_chars=32)
    first = {router.candidates(f"prompt number {i} " + "x" * 40)[0].url for i in range(60)}
    assert first == {"http://a", "http://b", "http://c"}
    shared = "You are a helpful assistant. " * 3
    assert len({router.candidates(shared + f"question {i}")[0].url for i in range(20)}) == 1


def test_load_beats_locality_only_past_the_imbalance():
    router = Router(["http://a", "http://b"], max_imbalance=4)
    preferred, other = router.candidates("some prompt")
    preferred.in_flight = 4
    assert router.candidates("some prompt")[0] is preferred
    preferred.in_flight = 5
    assert router.candidates("some prompt")[0] is other


def test_target_endpoint_and_health_decide_first():
    router = Router(["http://a", "http://b/"])
    assert router.candidates("p", target="http://b")[0].url == "http://b"
    with pytest.raises(APIError, match="target_endpoint"):
        router.candidates("p", target="http://nowhere")
    router.mark_down(router.backends[0], "test")
    assert [b.url for b in router.candidates("p")] == ["http://b"]
    router.mark_up(router.backends[0])
    assert len(router.candidates("p")) == 2


# ------------------------------------------------------------------------------------ two real servers
@pytest.fixture(scope="module")
def backends():
    """Two `petrel serve` processes on loopback (also tests/test_disagg.py's prefill and decode servers)."""
    procs = []
    ports = [_free_port() for _ in range(2)]
    try:
        errors = []
        with ThreadPoolExecutor(2) as pool:   # both start at once; one that started is stopped even if the other failed
            starting = [pool.submit(start_server, port, ["--max-num-seqs", "8"]) for port in ports]
            for port, future in zip(ports, starting):
                try:
                    procs.append((future.result(), f"http://127.0.0.1:{port}"))
                except RuntimeError as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]
        yield procs
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def router_url(backends):
    router = Router([url for _, url in backends], prefix_chars=128)
    with BackgroundServer(build_router_app(router, health_interval=0.5)) as srv:
        yield srv.url


def _complete(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)


def _served(url: str) -> dict:
    return {b["url"]: b["served"] for b in httpx.get(f"{url}/health", trust_env=False).json()["backends"]}


def test_requests_spread_and_a_shared_prefix_sticks_to_one_cache(router_url, backends):
    before = _served(router_url)
    for i in range(10):
        assert _complete(router_url, f"{i} * {i} is a number. Tell me about the number {i} in one line.").status_code == 200
    after = _served(router_url)
    assert all(after[u] > before[u] for _, u in backends), (before, after)

    prefix = "Here is a long document about seabirds. " * 12
    answers = [_complete(router_url, prefix + f"Question {i}: name one seabird.") for i in range(3)]
    assert {a.headers["x-petrel-backend"] for a in answers} == {answers[0].headers["x-petrel-backend"]}
    cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[1] > 0 and cached[2] > 0


def test_target_endpoint_streams_and_models(router_url, backends):
    target = backends[1][1]
    r = _complete(router_url, "Hello", target_endpoint=target)
    assert r.status_code == 200 and r.headers["x-petrel-backend"] == target
    r = httpx.post(f"{router_url}/v1/completions", headers={"X-Target-Endpoint": backends[0][1]}, trust_env=False,
                   json={"model": MODEL, "prompt": "Seabirds are", "max_tokens": 6, "stream": True}, timeout=120)
    assert r.headers["x-petrel-backend"] == backends[0][1]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "text_completion"
    models = httpx.get(f"{router_url}/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert _complete(router_url, "x", target_endpoint="http://127.0.0.1:1").status_code == 400


def test_killing_a_backend_loses_no_request_that_had_not_started(router_url, backends):
    (victim, victim_url), (_, survivor_url) = backends

    async def burst():
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            async def one(i):
                body = {"model": MODEL, "prompt": f"Request {i}: write a sentence about the ocean.", "max_tokens": 24,
                        "temperature": 0, "ignore_eos": True}
                return await client.post(f"{router_url}/v1/completions", json=body)
            tasks = [asyncio.create_task(one(i)) for i in range(12)]
            await asyncio.sleep(1.5)           # requests are in flight on both backends
            victim.send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200] * 12
    assert all(a.json()["usage"]["completion_tokens"] == 24 for a in answers)
    assert {a.headers["x-petrel-backend"] for a in answers} >= {survivor_url}
    health = {b["url"]: b for b in httpx.get(f"{router_url}/health", trust_env=False).json()["backends"]}
    assert not health[victim_url]["healthy"] and health[survivor_url]["healthy"]
    assert _complete(router_url, "After the crash").headers["x-petrel-backend"] == survivor_url


def test_no_backend_left_is_a_503(router_url, backends):
    for proc, _ in backends:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    r = _complete(router_url, "anyone there?")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
