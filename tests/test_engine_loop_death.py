"""The engine loop thread dying (an exception escaping the loop body, of any kind): every request in flight or
queued ends with an error, nothing hangs, check_health raises, new work is refused at once naming the cause, and
the server answers /health with 503 and requests with a 5xx JSON error.

Runs the loop on the tiny random Llama (the default tokenizer beside it). Every wait has its own timeout, so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from petrel import LLM, SamplingParams

WAIT = 10.0  # seconds any single wait may take before the test fails
CAUSE = "the engine loop has stopped: LoopKiller: injected"
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


class LoopKiller(BaseException):
    """Not an Exception: what a SystemExit-like error inside a step looks like to the loop."""


@pytest.fixture
def llm(tiny, tokenizer_dir):
    engine = LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


class KillSwitch:
    """Replaces obj.name: the first call signals `entered`, waits for `fire()`, then raises `error` (and so does
    every later call: the broken part stays broken while the dying loop fails its requests)."""

    def __init__(self, obj, name: str, error: BaseException):
        self.entered, self._go, self.error = threading.Event(), threading.Event(), error
        setattr(obj, name, self._call)

    def _call(self, *args, **kwargs):
        self.entered.set()
        self._go.wait(WAIT)
        raise self.error

    def wait_entered(self) -> None:
        assert self.entered.wait(WAIT), "the engine loop never reached the injected failure"

    def fire(self) -> None:
        self._go.set()


def _inject(llm, where: str) -> KillSwitch:
    error = LoopKiller("injected")
    if where == "step":  # a BaseException from inside a step (core.step catches only Exception)
        return KillSwitch(llm.engine.core, "step", error)
    if where == "dispatch":  # from _dispatch (handing a step's outputs over), outside the step's guard
        return KillSwitch(llm.engine, "_dispatch", error)
    raise AssertionError(where)


def _assert_dead(llm) -> None:
    """check_health raises; new work and round trips fail at once, naming the cause; nothing is left in flight."""
    engine = llm.engine
    engine._thread.join(WAIT)
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match=CAUSE):
        engine.check_health()
    for submit in (
        lambda: llm.generate([5, 6, 7], SamplingParams(max_tokens=2), use_tqdm=False),
        lambda: llm.generate_async([5, 6, 7], SamplingParams(max_tokens=2)),
        lambda: engine.call(lambda core: None, timeout=None),
    ):
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=CAUSE):
            submit()
        assert time.monotonic() - t0 < 1.0
    assert engine.num_unfinished_requests == 0


@pytest.mark.parametrize("where", ["step", "dispatch"])
def test_requests_in_flight_and_queued_get_an_error_when_the_loop_dies(llm, where):
    first = llm.generate_async([5, 6, 7], LONG)  # in the core when the loop dies
    switch = _inject(llm, where)
    switch.wait_entered()
    queued = llm.generate_async([8, 9], LONG)  # a command the dead loop never took
    streamed = llm.generate_async([10, 11], LONG, streaming=True)
    switch.fire()
    t0 = time.monotonic()
    for future in (first, queued):
        with pytest.raises(RuntimeError, match=f"request {future.request_id} failed: {CAUSE}"):
            future.result(timeout=WAIT)
    with pytest.raises(RuntimeError, match=CAUSE):
        for _ in streamed:
            pass
    assert time.monotonic() - t0 < 5.0
    assert all(co.finish_reason == "cancelled" for f in (first, queued, streamed) for co in f._builder.result().outputs)
    _assert_dead(llm)


def test_an_awaited_request_gets_an_error_when_the_loop_dies(llm):
    async def main():
        future = llm.generate_async([5, 6, 7], LONG)
        switch = _inject(llm, "step")
        await asyncio.to_thread(switch.wait_entered)
        switch.fire()
        with pytest.raises(RuntimeError, match=CAUSE):
            await asyncio.wait_for(future._wait_async(), WAIT)
        with pytest.raises(RuntimeError, match=CAUSE):
            async for _ in llm.generate_async([8, 9], LONG, streaming=True):
                pass

    asyncio.run(main())
    _assert_dead(llm)


def test_a_plain_exception_from_handling_a_command_kills_the_loop_cleanly(llm):
    """An Exception escaping _handle (here: the core refusing a request it was handed) is outside the step's guard:
    the loop dies, and the request in flight as well as the one that broke it get an error."""
    first = llm.generate_async([5, 6, 7], LONG)
    llm.engine.call(lambda core: None, timeout=WAIT)  # a round trip: `first` is in the core now

    def refuse(request):
        raise KeyError("bad request")

    llm.engine.core.add_request = refuse
    breaking = llm.generate_async([8, 9], LONG)
    for future in (first, breaking):
        with pytest.raises(RuntimeError, match="the engine loop has stopped: KeyError: 'bad request'"):
            future.result(timeout=WAIT)
    with pytest.raises(RuntimeError, match="KeyError"):
        llm.engine.check_health()


def test_the_server_answers_503_and_5xx_after_the_loop_dies(llm):
    from fastapi.testclient import TestClient

    from petrel.serve.app import build_app

    client = TestClient(build_app(llm, health_timeout=2.0))
    assert client.get("/health").status_code == 200
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    answers = {}

    def post(name, **extra):
        if extra.get("stream"):
            with client.stream("POST", "/v1/completions", json={**body, **extra}) as r:
                answers[name] = (r.status_code, [line for line in r.iter_lines() if line])
        else:
            r = client.post("/v1/completions", json={**body, **extra})
            answers[name] = (r.status_code, r.json())

    switch = _inject(llm, "step")
    threads = [
        threading.Thread(target=post, args=("plain",), daemon=True),
        threading.Thread(target=post, args=("stream",), kwargs={"stream": True}, daemon=True),
    ]
    for t in threads:
        t.start()
    switch.wait_entered()
    deadline = time.monotonic() + WAIT
    while llm.engine.num_unfinished_requests < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.engine.num_unfinished_requests == 2
    switch.fire()
    for t in threads:
        t.join(WAIT)
        assert not t.is_alive(), "an HTTP request hung after the engine loop died"
    status, error = answers["plain"]
    assert status == 500 and CAUSE in error["error"]["message"]
    status, lines = answers["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    assert CAUSE in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]

    r = client.get("/health")
    assert r.status_code == 503 and CAUSE in r.json()["error"]["message"]
    t0 = time.monotonic()
    r = client.post("/v1/completions", json=body)
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 503 and CAUSE in r.json()["error"]["message"]


def test_a_shutdown_still_ends_requests_and_refuses_new_work(llm):
    """The same path on a clean shutdown: the request in flight ends with an error, new work and round trips are
    refused at once, check_health raises."""
    future = llm.generate_async([5, 6, 7], LONG)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="the engine has been shut down"):
        future.result(timeout=WAIT)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the engine has been shut down"):
        llm.generate_async([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="the engine has been shut down"):
        llm.engine.call(lambda core: None, timeout=None)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(RuntimeError, match="not running"):
        llm.engine.check_health()
