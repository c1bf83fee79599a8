"""Server limits and shutdown: a full server answers 429 and recovers, an oversized body is a 413, a stalled body a
408, half-sent headers are cut off, connections past the cap are refused at once while /health still answers,
resource-exhaustion log lines are rate-limited, and SIGTERM ends in-flight streams with a final error event and
exits 0."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref

import httpx
import pytest

from petrel.heap import can_release, freeze_startup_objects, thaw_frozen_objects
from petrel.serve.app import build_app
from petrel.serve.connections import (
    ConnectionGuard,
    RateLimitedLogFilter,
    default_backlog,
    default_max_connections,
    install_exhaustion_log_filter,
    raise_open_file_limit,
)
from petrel.serve.limits import TRIM_AFTER_BYTES, BodySizeLimit, HeapTrimmer
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
    app.state.petrel.max_pending = 2  # as if --max-num-seqs + --max-queue-len were 2
    baseline = free_blocks(llm)
    with BackgroundServer(app) as srv:
        url = f"{srv.url}/v1/completions"
        long = {"prompt": "Count slowly:", "max_tokens": 400, "stream": True, "ignore_eos": True}
        runs = [([], threading.Event()) for _ in range(2)]
        threads = [
            threading.Thread(target=_stream_until_first_token, args=(url, long, ev, st), daemon=True) for ev, st in runs
        ]
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
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200  # health is never refused
        llm.engine.abort_all("test over")  # the two long streams end...
        for t in threads:
            t.join(30)
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text  # ...and the server takes work again
    deadline = time.monotonic() + 10
    while free_blocks(llm) != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_blocks(llm) == baseline


def test_oversized_body_is_413(llm):
    with BackgroundServer(build_app(llm, max_request_bytes=64 * 1024)) as srv:
        big = {"prompt": "x" * 100_000, "max_tokens": 1}
        r = httpx.post(f"{srv.url}/v1/completions", json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            payload = json.dumps(big).encode()
            for i in range(0, len(payload), 8192):
                yield payload[i : i + 8192]

        r = httpx.post(
            f"{srv.url}/v1/completions", content=chunks(), timeout=30, headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200


def _connect(srv, sent: bytes = b"") -> socket.socket:
    s = socket.create_connection((srv.host, srv.port), timeout=10)
    if sent:
        s.sendall(sent)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it does not)."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _eventually(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _error_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]


def test_half_sent_headers_are_closed_after_the_header_timeout(llm):
    with BackgroundServer(build_app(llm), header_timeout=1.0) as srv:
        t0 = time.monotonic()
        slow = [_connect(srv, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(20)]
        silent = _connect(srv)  # connected, never sends a byte
        for _ in range(3):  # a header line now and then does not extend the deadline
            time.sleep(0.3)
            for s in slow:
                s.sendall(b"X-Slow: 1\r\n")
        for s in slow:
            response = _read_until_closed(s)
            assert response.startswith(b"HTTP/1.1 408 "), response[:80]
            assert _error_of(response)["code"] == "request_timeout"
        assert _read_until_closed(silent) == b""  # nothing to answer: just closed
        assert time.monotonic() - t0 < 1.0 + 2.0
        # a connection that finished a request gets the same deadline for the next one's headers
        kept = _connect(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n")
        response = _read_until_closed(kept)
        assert response.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in response
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        assert srv.guard.totals["header_timeout"] == 22
        assert _eventually(lambda: not srv.guard.admitted)  # every connection closed is forgotten


def test_connections_past_the_cap_are_refused_at_once_and_health_still_answers(llm):
    with (
        BackgroundServer(build_app(llm), header_timeout=60, max_connections=8) as srv,
        httpx.Client(base_url=srv.url, timeout=5) as keep_alive,
    ):
        assert keep_alive.get("/health").status_code == 200
        srv.guard.evict_after = 60.0  # first: nothing old enough to evict
        slow = [_connect(srv, b"GET /health HTTP/1.1\r\n") for _ in range(7)]
        _eventually(lambda: len(srv.guard.admitted) == 8)  # the server has taken them all
        t0 = time.monotonic()
        extra = _connect(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = _read_until_closed(extra)
        assert time.monotonic() - t0 < 0.5
        assert response.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in response.lower()
        assert _error_of(response)["code"] == "too_many_connections"
        assert keep_alive.get("/health").status_code == 200  # the client already in keeps working
        srv.guard.evict_after = 0.2  # now: a newcomer evicts the oldest half-sent connection
        time.sleep(0.3)
        newcomers = [httpx.Client(base_url=srv.url, timeout=5) for _ in range(3)]
        for client in newcomers:  # each stays connected: each needs a slot
            assert client.get("/health").status_code == 200
        assert [_read_until_closed(s) for s in slow[:3]] == [b""] * 3 and srv.guard.totals["evicted"] == 3
        assert keep_alive.get("/health").status_code == 200
        assert srv.guard.totals["refused"] == 1 and len(srv.guard.admitted) <= 8
        for c in [*newcomers, *slow]:
            c.close()


def test_a_stalled_body_is_408(llm):
    with BackgroundServer(build_app(llm, body_timeout=0.5)) as srv:
        s = _connect(
            srv,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": ',
        )
        t0 = time.monotonic()
        response = _read_until_closed(s)
        assert 0.4 < time.monotonic() - t0 < 3.0
        assert response.startswith(b"HTTP/1.1 408 ") and b"connection: close" in response.lower()
        err = _error_of(response)
        assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error" and "0.5 s" in err["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200  # a body sent at once is not affected


def test_a_large_body_is_read_in_linear_time():
    """16 MB in 2 KB chunks (a client picks its chunking): joining them by bytes += copied 68 GB on the event loop
    (10-60 s here, /health stalled meanwhile); now each byte is copied about once (0.2 s)."""
    chunk, n = b"x" * 2048, 8192
    seen = {}

    async def app(scope, receive, send):
        seen["body"] = (await receive())["body"]

    async def receive():
        seen["chunks"] = seen.get("chunks", 0) + 1
        return {"type": "http.request", "body": chunk, "more_body": seen["chunks"] < n}

    limit = BodySizeLimit(app, max_bytes=len(chunk) * n)
    t0 = time.perf_counter()
    asyncio.run(limit({"type": "http", "headers": []}, receive, None))
    assert time.perf_counter() - t0 < 2.0
    assert seen["body"] == chunk * n


def test_memory_a_large_body_freed_is_handed_back_once_per_burst():
    trims = []
    trimmer = HeapTrimmer(release=lambda: trims.append(0), interval=0.3)

    async def app(scope, receive, send):
        await receive()

    def receive_of(size: int):
        async def receive():
            return {"type": "http.request", "body": b"x" * size, "more_body": False}

        return receive

    async def requests():
        limit = BodySizeLimit(app, trimmer=trimmer)
        await limit({"type": "http", "headers": []}, receive_of(1000), None)  # small: no trim
        await asyncio.sleep(0.1)
        assert trims == []
        for _ in range(5):  # a burst: one trim
            await limit({"type": "http", "headers": []}, receive_of(TRIM_AFTER_BYTES), None)
        await asyncio.sleep(0.1)
        assert trims == [0]
        await limit({"type": "http", "headers": []}, receive_of(TRIM_AFTER_BYTES), None)
        await asyncio.sleep(0.1)
        assert trims == [0]  # not yet: within 0.3 s
        await asyncio.sleep(0.4)
        assert trims == [0, 0]  # the burst's last one

    asyncio.run(requests())


def test_the_trim_first_collects_the_cycles_a_refused_body_is_held_in():
    """A refused request's parsed body stays reachable from its exception's traceback cycle until the collector
    runs: the trim after a large body collects first, so that memory is free when it is handed back."""
    if not can_release():
        pytest.skip("no malloc_trim: no trim")

    class Body:  # a parsed body caught in a cycle, as an exception's traceback holds it
        pass

    body = Body()
    body.cycle = body
    alive = weakref.ref(body)
    del body

    async def trim():
        HeapTrimmer(interval=0.0).request()
        assert await _eventually_async(lambda: alive() is None, timeout=5)

    gc.disable()  # no collection but the trimmer's own
    try:
        asyncio.run(trim())
    finally:
        gc.enable()


async def _eventually_async(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_rss_comes_back_after_huge_refused_prompts(llm):
    """Nine 10 MB prompts, four at a time, all refused: glibc kept what they freed (RSS +560 MiB for good);
    now the server hands it back."""
    import psutil

    text = "lorem ipsum " * (10 * 2**20 // 12)
    bodies = [
        ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 1})),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1})),
        ("/v1/completions", json.dumps({"prompt": [42] * 2_000_000, "max_tokens": 1})),
    ] * 3
    process = psutil.Process()
    with BackgroundServer(build_app(llm)) as srv:
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).is_success
        before = process.memory_info().rss
        statuses = []

        def post(path_body):
            path, body = path_body
            r = httpx.post(f"{srv.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120)
            statuses.append(r.status_code)

        threads = [threading.Thread(target=post, args=(pb,)) for pb in bodies]
        for i in range(0, len(threads), 4):
            for t in threads[i : i + 4]:
                t.start()
            for t in threads[i : i + 4]:
                t.join()
        assert statuses == [400] * len(bodies)
        del bodies, text
        assert _eventually(lambda: process.memory_info().rss < before + 150 * 2**20, timeout=10), (
            f"RSS {before / 2**20:.0f} -> {process.memory_info().rss / 2**20:.0f} MiB"
        )


def test_default_connection_cap_fits_under_the_open_file_limit():
    assert default_max_connections(1024) == 512 and default_max_connections(20000) == 4096
    assert default_max_connections(40) == 32
    assert default_backlog(1024) == 256 and default_backlog(20000) == 2048  # cap + one burst of accepts fit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = raise_open_file_limit()  # `petrel serve` starts with its soft limit at the hard one
    assert raised == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft
    assert raised == hard or hard == resource.RLIM_INFINITY
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionGuard(max_connections=0)
    with pytest.raises(ValueError, match="header_timeout"):
        ConnectionGuard(header_timeout=0)


def test_startup_objects_are_frozen_out_of_the_collectors_reach(llm):
    """A full collection traversed the model's and libraries' objects (~0.5 s, several times a minute under
    connection churn), stalling the event loop; `petrel serve` freezes them before it listens."""
    build_app(llm)
    thaw_frozen_objects()
    t0 = time.perf_counter()
    gc.collect()
    unfrozen = time.perf_counter() - t0
    freeze_startup_objects()
    t0 = time.perf_counter()
    gc.collect()
    frozen = time.perf_counter() - t0
    assert frozen < 0.05 and frozen < unfrozen / 3, (unfrozen, frozen)


def test_llm_freezes_what_start_up_left_and_shutdown_thaws_it(tiny, tokenizer_dir):
    """LLM() freezes the objects alive after loading (a full collection during W2 took 0.12 s before); its
    shutdown hands them back, so that an engine's cycles (its model's tensors) can be freed."""
    from petrel import LLM

    thaw_frozen_objects()
    engine = LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    try:
        assert gc.get_freeze_count() > 0
        model = engine.engine.call(lambda core: core.runner.model)
        assert not any(o is model for o in gc.get_objects())  # in no generation the collector walks
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0 and any(o is model for o in gc.get_objects())


def _exhaustion_record(message: str = "socket.accept() out of system resource") -> logging.LogRecord:
    exc = OSError(errno.EMFILE, "Too many open files")
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, (OSError, exc, None))


def test_exhaustion_log_lines_are_rate_limited_with_a_count():
    now = [0.0]
    f = RateLimitedLogFilter(interval=10.0, clock=lambda: now[0])
    assert f.filter(_exhaustion_record())
    assert sum(f.filter(_exhaustion_record()) for _ in range(999)) == 0
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "something else", None, None)
    assert f.filter(other) and other.getMessage() == "something else"
    now[0] = 10.5
    record = _exhaustion_record()
    assert f.filter(record)
    assert "999 more like this in the last 10 s were not logged" in record.getMessage()
    assert not f.filter(_exhaustion_record("Exception in ASGI application"))  # EMFILE from a handler counts too
    try:
        try:
            raise OSError(errno.EMFILE, "Too many open files")
        except OSError as cause:
            raise RuntimeError("can't start new thread") from cause
    except RuntimeError as exc:
        chained = logging.LogRecord(
            "uvicorn.error",
            logging.ERROR,
            __file__,
            1,
            "Exception in ASGI application",
            None,
            (RuntimeError, exc, None),
        )
    assert not f.filter(chained)  # ...and as a cause
    assert f.suppressed == 2


def test_asyncio_accept_errors_reach_the_log_once(caplog):
    install_exhaustion_log_filter()
    install_exhaustion_log_filter()  # idempotent

    async def fail_accepts():  # what asyncio's accept loop does on EMFILE
        loop = asyncio.get_running_loop()
        for _ in range(500):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                }
            )

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(fail_accepts())
    lines = [r for r in caplog.records if "out of system resource" in r.getMessage()]
    assert len(lines) <= 1
    assert sum(isinstance(f, RateLimitedLogFilter) for f in logging.getLogger("asyncio").filters) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_ends_streams_with_a_final_event_and_exits_0():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "petrel.cli", "serve", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
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
        reader = threading.Thread(
            target=_stream_until_first_token,
            daemon=True,
            args=(
                f"{base}/v1/completions",
                {"prompt": "Tell a long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True},
                events,
                started,
            ),
        )
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
