"""The engine loop does engine work only; the front end (detokenizing, stop strings, logprob text, RequestOutputs,
executor Responses, server events) runs on the consumer's side, and a long stream keeps no per-step history.

- No detokenizing, output processing or RequestOutput assembly on the engine thread, for every front: the LLM API
  (result, iteration, async iteration, several sequences, logprobs, stop strings), the executor and the server.
- A stop string found by the consumer ends the engine's sequence (blocks back, nothing in flight, the id reusable at
  once), and the visible output is the same whether the consumer saw it at once or only after the engine had run
  on to max_tokens.
- Streamed updates are views: holding every update of an N-token stream holds O(N) items, not O(N^2), and an update
  never changes after later steps. The loop hands over one output per step per sequence, with that step's tokens.
- A finished request leaves no chunk or raw output behind, in the future or in the engine.

Runs on the tiny random Llama (the default tokenizer beside it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import pytest

from petrel import LLM, SamplingParams, TextGenerationRequest
from petrel.engine.engine_output import EngineOutput
from petrel.engine.output_processor import RequestOutputProcessor
from petrel.outputs import OutputChunk
from petrel.request_output_builder import RequestOutputBuilder, StreamedCompletionOutput
from tests.conftest import free_blocks

ENGINE_THREAD = "petrel-engine"
LONG = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny, tokenizer_dir):
    engine = LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


class ThreadLog:
    """Records the thread of every call to the front-end functions it wraps."""

    def __init__(self, monkeypatch, tokenizer):
        self.threads: dict[str, set[str]] = {}
        for owner, name in [
            (RequestOutputProcessor, "process"),
            (RequestOutputBuilder, "apply"),
            (RequestOutputBuilder, "partial"),
            (RequestOutputBuilder, "result"),
            (tokenizer, "decode"),
        ]:
            monkeypatch.setattr(
                owner, name, self._wrap(f"{getattr(owner, '__name__', 'tokenizer')}.{name}", getattr(owner, name))
            )

    def _wrap(self, label: str, fn):
        def recorded(*args, **kwargs):
            self.threads.setdefault(label, set()).add(threading.current_thread().name)
            return fn(*args, **kwargs)

        return recorded

    def check(self, *expected: str) -> None:
        for label in expected:
            assert self.threads.get(label), f"{label} was never called"
        on_engine = {label for label, names in self.threads.items() if ENGINE_THREAD in names}
        assert not on_engine, f"front-end work on the engine thread: {sorted(on_engine)}"


def _stop_inside(text: str) -> tuple[str, str]:
    """A stop string from the middle of `text` and the text a request stopping at it shows."""
    for start in range(len(text) // 2, len(text) - 2):
        stop = text[start : start + 2]
        at = text.find(stop)
        if at > 0 and stop.strip() and "\ufffd" not in stop:
            return stop, text[:at]
    raise AssertionError(f"no stop string found in {text!r}")


def test_the_engine_thread_does_no_front_end_work(llm, monkeypatch):
    plain = llm.generate([5, 6, 7], SamplingParams(max_tokens=40, **LONG), use_tqdm=False).outputs[0]
    stop, _ = _stop_inside(plain.text)
    log = ThreadLog(monkeypatch, llm.tokenizer)
    params = SamplingParams(max_tokens=40, stop=[stop], logprobs=3, prompt_logprobs=2, n=2, **LONG)
    out = llm.generate([5, 6, 7], params, use_tqdm=False)
    assert [co.finish_reason for co in out.outputs] == ["stop", "stop"]
    assert out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].decoded_token is not None
    partial = list(llm.generate_async([5, 6, 7], params, streaming=True))[-1]
    assert partial.finished and partial.outputs[1].text == out.outputs[1].text

    async def stream():
        return [p.outputs[0].text_diff async for p in llm.generate_async([5, 6, 7], params, streaming=True)]

    assert "".join(asyncio.run(stream())) == out.outputs[0].text
    log.check(
        "RequestOutputProcessor.process",
        "RequestOutputBuilder.apply",
        "RequestOutputBuilder.partial",
        "RequestOutputBuilder.result",
        "tokenizer.decode",
    )


def test_the_server_and_the_executor_do_their_output_work_off_the_engine_thread(llm, tiny, tokenizer_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from petrel.config import EngineConfig
    from petrel.executor import Executor, Request
    from petrel.serve.app import build_app

    log = ThreadLog(monkeypatch, llm.tokenizer)
    client = TestClient(build_app(llm))
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) > 3
    assert client.post("/v1/completions", json=body).status_code == 200
    log.check("RequestOutputProcessor.process", "tokenizer.decode")

    with Executor(
        EngineConfig.from_kwargs(model=tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    ) as ex:
        rid = ex.enqueue_request(Request([5, 6, 7], 8, streaming=True))
        got = []
        while not (got and got[-1].result.is_final):
            got += ex.await_responses(rid, timeout=30)
        assert sum(len(r.result.output_token_ids[0]) for r in got) == 8
    log.check("RequestOutputProcessor.process")


def test_a_stop_string_found_by_the_consumer_ends_the_engine_sequence(llm):
    plain = llm.generate([9, 10, 11], SamplingParams(max_tokens=60, **LONG), use_tqdm=False).outputs[0]
    stop, shown = _stop_inside(plain.text)
    baseline = free_blocks(llm)
    params = SamplingParams(max_tokens=60, stop=[stop], **LONG)
    eager = llm.generate(
        TextGenerationRequest("stop-1", prompt=[9, 10, 11], sampling_params=params), use_tqdm=False
    ).outputs[0]
    assert (eager.text, eager.finish_reason, eager.stop_reason) == (shown, "stop", stop)
    assert eager.token_ids == plain.token_ids[: len(eager.token_ids)] and len(eager.token_ids) < 60
    # the same id at once: the request stopped counting as in flight when its consumer saw the stop
    again = llm.generate(TextGenerationRequest("stop-1", prompt=[9, 10, 11], sampling_params=params), use_tqdm=False)
    assert again.outputs[0].token_ids == eager.token_ids
    assert llm.engine.call(lambda core: len(core.requests)) == 0
    assert free_blocks(llm) == baseline and llm.engine.num_unfinished_requests == 0

    # nobody waits: the engine cannot see the stop string and runs on to max_tokens; the output is the same
    lazy = llm.generate_async([9, 10, 11], params)
    deadline = time.monotonic() + 30
    while llm.engine.num_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.engine.num_unfinished_requests == 0
    late = lazy.result(timeout=30).outputs[0]
    assert (late.text, late.token_ids, late.finish_reason, late.stop_reason) == (
        eager.text,
        eager.token_ids,
        "stop",
        stop,
    )
    assert free_blocks(llm) == baseline


def _list_items_held(roots) -> int:
    """Items in the distinct lists reachable from `roots` through containers and plain attributes (properties are
    not read, so nothing is materialized)."""
    seen, total, todo = set(), 0, list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            total += len(obj) if isinstance(obj, list) else 0
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return total


def test_streamed_updates_are_views_not_copies(llm):
    n = 200
    params = SamplingParams(max_tokens=n, logprobs=2, **LONG)
    handed_over = []
    future = llm.generate_async([12, 13, 14], params, streaming=True)
    sink = future._route.sink
    future._route.sink = lambda out: (handed_over.append(len(out.new_token_ids)), sink(out))
    updates = []
    for update in future:
        updates.append(update)
        time.sleep(0.002)  # a consumer a little slower than the engine: some updates cover several steps
    final = future.result()
    co = final.outputs[0]
    assert len(co.token_ids) == n and isinstance(updates[0].outputs[0], StreamedCompletionOutput)
    # the loop handed over each step's output alone: one token each (it missed those sent before the patch)
    assert all(k == 1 for k in handed_over) and n // 2 <= len(handed_over) <= n
    # every update the caller kept, all together: O(n) list items (copies of the output so far: O(n^2))
    held = _list_items_held(updates)
    assert held < 10 * n, f"{len(updates)} updates hold {held} list items"
    # diffs add up; each update still shows the output as of its own step
    assert [t for u in updates for t in u.outputs[0].token_ids_diff] == co.token_ids
    assert "".join(u.outputs[0].text_diff for u in updates) == co.text
    for u in updates[::17]:
        k = u.outputs[0].length
        assert u.outputs[0].token_ids == co.token_ids[:k] and u.outputs[0].logprobs == co.logprobs[:k]
        assert co.text.startswith(u.outputs[0].text)
    assert updates[-1].outputs[0] == StreamedCompletionOutput(**{f: getattr(co, f) for f in co.__dataclass_fields__})


def _reachable_types(root, skip) -> set[type]:
    seen, types, todo = set(), set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or any(obj is s for s in skip):
            continue
        seen.add(id(obj))
        types.add(type(obj))
        if isinstance(obj, (list, tuple, set, deque)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif hasattr(obj, "__dict__") and not callable(obj):
            todo.extend(vars(obj).values())
    return types


def test_a_finished_stream_keeps_no_chunks(llm):
    params = SamplingParams(max_tokens=50, logprobs=1, **LONG)
    iterated = llm.generate_async([15, 16], params, streaming=True)
    for _ in iterated:
        pass
    chunked = llm.generate_async([15, 16], params, streaming=True)
    assert len(list(chunked.output_chunks())) == 50
    for future in (iterated, chunked):
        types = _reachable_types(future, skip=[llm.engine, llm.tokenizer])
        assert OutputChunk not in types and EngineOutput not in types
    assert llm.engine.call(lambda core: len(core.requests)) == 0
    assert llm.engine._routes == {} and llm.engine.num_unfinished_requests == 0

    async def server_style():  # the server's streams: the future keeps the token ids, no text or logprobs
        future = llm.generate_async([15, 16], params, streaming=True)
        text = "".join([c.text async for c in future.output_chunks_async(keep_history=False)])
        return future, text

    future, text = asyncio.run(server_style())
    result = future.result(timeout=0).outputs[0]
    assert len(result.token_ids) == 50 and text and result.text == "" and result.logprobs is None


def test_a_batch_without_stop_strings_wakes_its_caller_only_when_sequences_end(llm, monkeypatch):
    """LLM.generate's thread sleeps through the steps of requests that have nothing to find between steps (no stop
    strings), so it does not compete with the engine's threads every step; with a stop string it wakes each step."""
    import types

    import petrel.llm

    waits = []

    class CountingEvent(threading.Event):
        def wait(self, timeout=None):
            waits.append(1)
            return super().wait(timeout)

    monkeypatch.setattr(petrel.llm, "threading", types.SimpleNamespace(Event=CountingEvent))
    prompts = [[9, 10, 11], [12, 13], [14, 15, 16, 17]]
    quiet = llm.generate(prompts, SamplingParams(max_tokens=40, **LONG), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in quiet] == [40, 40, 40]
    assert len(waits) <= len(prompts), len(waits)  # at most once per finished request
    # the outputs are the same as when processed step by step
    streamed = [list(llm.generate_async(p, SamplingParams(max_tokens=40, **LONG), streaming=True))[-1] for p in prompts]
    assert [o.outputs[0].text for o in quiet] == [s.outputs[0].text for s in streamed]

    waits.clear()
    stop, shown = _stop_inside(quiet[0].outputs[0].text)
    stopped = llm.generate(prompts[:1], SamplingParams(max_tokens=40, stop=[stop], **LONG), use_tqdm=False)[0]
    assert stopped.outputs[0].text == shown and stopped.outputs[0].finish_reason == "stop"
    assert len(waits) >= len(stopped.outputs[0].token_ids) // 2  # woken by the steps, to find the stop string
