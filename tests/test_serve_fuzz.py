"""Fuzzing the real server from its own OpenAPI document (schemathesis 4): valid and invalid requests to every
POST route and GET /v1/models. No response may be a 5xx, every error body has the OpenAI shape, and afterwards
the engine holds no request and every KV block is free again.

Generation is kept cheap: the app allows n <= 2 and each generated body has its max_tokens /
max_completion_tokens clamped to at most 4 (set to 4 when absent) before it is sent. Hypothesis runs
derandomized (a fixed seed), so CI sees the same cases every run.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")

from petrel.serve.app import build_app  # noqa: E402
from petrel.serve.server import BackgroundServer  # noqa: E402
from tests.conftest import free_blocks  # noqa: E402

pytestmark = pytest.mark.e2e

OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/embeddings"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
]
MAX_GEN_TOKENS = 4
POSITIVE_EXAMPLES, NEGATIVE_EXAMPLES = 40, 20  # 60 per operation
STATUSES: dict[str, list[int]] = {}  # path -> statuses seen (the fuzzing must reach 200s too)


@pytest.fixture(scope="module")
def fuzz_server(llm):
    srv = BackgroundServer(build_app(llm, max_n=2))
    srv.baseline_free_blocks = free_blocks(llm)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_server):
    app = fuzz_server.server.config.app
    return schemathesis.openapi.from_dict(app.openapi())


def cheap(case) -> None:
    """At most MAX_GEN_TOKENS generated tokens per choice, whatever the fuzzer picked."""
    body = case.body
    if case.path == "/v1/responses" and isinstance(body, dict):
        value = body.get("max_output_tokens")
        if not isinstance(value, int) or isinstance(value, bool) or value > MAX_GEN_TOKENS:
            body["max_output_tokens"] = MAX_GEN_TOKENS  # absent or null: no limit; a wrong type is refused anyway
        return
    if case.path not in ("/v1/completions", "/v1/chat/completions") or not isinstance(body, dict):
        return
    body.pop(
        "disaggregated_params", None
    )  # it makes the server fetch KV from the endpoint given (tests/test_disagg.py)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_GEN_TOKENS:
            body[key] = MAX_GEN_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # absent or null: no limit
        body["max_tokens"] = MAX_GEN_TOKENS


def _content_type(response) -> str:
    """schemathesis 4 keeps each header as a list of values."""
    value = response.headers.get("content-type") or response.headers.get("Content-Type") or ""
    return " ".join(value) if isinstance(value, (list, tuple)) else value


def check_response(case, response) -> None:
    label = f"{case.method} {case.path} body={json.dumps(case.body, default=repr)[:2000]}"
    assert response.status_code < 500, f"{label} -> {response.status_code} {response.text[:2000]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, f"{label} -> {body}"
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, f"{label} -> {body}"
        assert isinstance(err["message"], str) and err["message"], f"{label} -> {body}"
        assert isinstance(err["type"], str), f"{label} -> {body}"
    elif "text/event-stream" in _content_type(response):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        if case.path == "/v1/responses":  # OpenAI's Responses streams end with their final event, not [DONE]
            final = json.loads(events[-1])["type"] if events else None
            assert final in ("response.completed", "response.incomplete", "response.failed"), f"{label} -> {final}"
            events.append("[DONE]")
        assert events and events[-1] == "[DONE]", f"{label} -> {response.text[-500:]}"
        for event in events[:-1]:
            json.loads(event)
    else:
        response.json()


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[p for _, p in OPERATIONS])
def test_fuzz_operation_never_500s(llm, fuzz_server, fuzz_schema, method, path):
    operation = fuzz_schema[path][method]
    modes = [
        (schemathesis.GenerationMode.POSITIVE, POSITIVE_EXAMPLES),
        (schemathesis.GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES),
    ]
    for mode, examples in modes:

        @settings(
            max_examples=examples,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            cheap(case)
            response = case.call(base_url=fuzz_server.url, timeout=60)
            STATUSES.setdefault(path, []).append(response.status_code)
            check_response(case, response)

        run()
    seen = STATUSES[path]
    assert 200 in seen, f"{path}: no request got through ({sorted(set(seen))})"
    if path != "/v1/models":
        assert any(400 <= s < 500 for s in seen), f"{path}: no request was refused ({sorted(set(seen))})"


def test_fuzzing_left_nothing_in_the_engine(llm, fuzz_server):
    baseline = fuzz_server.baseline_free_blocks
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if llm.engine.num_unfinished_requests == 0 and free_blocks(llm) == baseline:
            break
        time.sleep(0.1)
    assert llm.engine.num_unfinished_requests == 0
    assert free_blocks(llm) == baseline
    print({p: {s: v.count(s) for s in sorted(set(v))} for p, v in STATUSES.items()})
