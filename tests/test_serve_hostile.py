"""Hostile inputs against the real server: each one gets a 4xx with a clear message naming the problem (or, where
the input is legitimate, a well-formed 200) in bounded time, never a 500, and the server keeps serving."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from petrel.serve.app import build_app
from petrel.serve.params import MAX_STOP_STRINGS
from petrel.serve.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS
from petrel.serve.server import BackgroundServer
from tests.conftest import free_blocks

pytestmark = pytest.mark.e2e

SMALL_CONTEXT = 48  # the server's context limit in the at-the-limit cases (generation there stays cheap)


@pytest.fixture(scope="module")
def server(llm):
    from petrel.heap import freeze_startup_objects, thaw_frozen_objects

    srv = BackgroundServer(build_app(llm))
    srv.baseline = free_blocks(llm)
    # as `petrel serve` does at start-up: what is alive now (here the whole test session's heap) leaves the
    # collector's generations, so a collection the requests' allocations trigger does not walk it on the event loop
    freeze_startup_objects()
    try:
        with srv:
            yield srv
    finally:
        thaw_frozen_objects()


@pytest.fixture(scope="module")
def small_server(llm):
    app = build_app(llm, max_n=4)
    app.state.petrel.limits.max_model_len = SMALL_CONTEXT  # as if the model's context were 48 tokens
    with BackgroundServer(app) as srv:
        yield srv


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def nested(leaf, depth: int) -> dict:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def raw(text: str) -> bytes:
    return text.encode("utf-8")


C, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
USER = [{"role": "user", "content": "Hi"}]
OBJECT = {"type": "object"}


def flat_tool(parameters) -> dict:
    return {"type": "function", "name": "f", "parameters": parameters}


# (id, path, body (dict: sent as JSON; bytes: sent as is), allowed statuses, the field the error names or a
#  phrase its message contains, or both as a (field, phrase) pair (None: a 200 case))
CASES = [
    ("invalid_utf8_bytes", C, b'{"prompt": "ab\xff\xfe\xc3(", "max_tokens": 2}', {400}, "JSON"),
    ("lone_surrogate_escape", C, raw('{"prompt": "x\\ud800y", "max_tokens": 2}'), {400}, "prompt"),
    (
        "lone_surrogate_in_chat",
        CHAT,
        raw('{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
        {400},
        "messages",
    ),
    ("lone_surrogate_in_stop", C, raw('{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}'), {400}, "stop"),
    ("control_characters", C, {"prompt": "a\x00b\x01\x07\x1b[31m\x7f\u202e\ufeff", "max_tokens": 2}, {200}, None),
    (
        "control_characters_chat",
        CHAT,
        {"messages": [{"role": "user", "content": "\x00\x1b\x08"}], "max_tokens": 2},
        {200},
        None,
    ),
    ("stop_5000_strings", C, {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(5000)]}, {400}, "stop"),
    (
        "stop_just_over_limit",
        CHAT,
        {"messages": USER, "max_tokens": 2, "stop": ["x"] * (MAX_STOP_STRINGS + 1)},
        {400},
        "stop",
    ),
    (
        "stop_at_limit",
        C,
        {"prompt": "hi", "max_tokens": 2, "stop": [f"z{i}" for i in range(MAX_STOP_STRINGS)]},
        {200},
        None,
    ),
    ("catastrophic_regex", C, {"prompt": "Say a:", "max_tokens": 6, "guided_regex": "(a+)+$"}, {200, 400}, "regex"),
    (
        "catastrophic_regex_nested",
        C,
        {"prompt": "Say a:", "max_tokens": 6, "guided_regex": "((a|aa)+)+(b|c)*\\1$"},
        {200, 400},
        "regex",
    ),
    (
        "json_schema_depth_200",
        C,
        {"prompt": "{", "max_tokens": 4, "guided_json": nested_schema(200)},
        {200, 400},
        "guided_json",
    ),
    (
        "json_schema_self_ref",
        C,
        {"prompt": "{", "max_tokens": 4, "guided_json": {"$ref": "#"}},
        {200, 400},
        "guided_json",
    ),
    (
        "json_schema_self_ref_property",
        C,
        {
            "prompt": "{",
            "max_tokens": 4,
            "guided_json": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
        },
        {200, 400},
        "guided_json",
    ),
    ("json_body_nested_100k", C, raw('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"), {400}, "JSON"),
    ("wrong_role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}, {400}, "role"),
    ("role_missing", CHAT, {"messages": [{"content": "hi"}], "max_tokens": 2}, {400}, "role"),
    ("messages_empty", CHAT, {"messages": [], "max_tokens": 2}, {400}, "messages"),
    ("n_at_limit", C, {"prompt": "hi", "max_tokens": 1, "n": 16}, {200}, None),
    ("n_over_limit", C, {"prompt": "hi", "max_tokens": 1, "n": 17}, {400}, "n"),
    ("n_huge", C, {"prompt": "hi", "max_tokens": 1, "n": 10**12}, {400}, "n"),
    ("n_zero", C, {"prompt": "hi", "max_tokens": 1, "n": 0}, {400}, "n"),
    ("max_tokens_zero", C, {"prompt": "hi", "max_tokens": 0}, {400}, "max_tokens"),
    ("max_tokens_negative", CHAT, {"messages": USER, "max_tokens": -5}, {400}, "max_tokens"),
    ("max_tokens_2_pow_70", C, {"prompt": "hi", "max_tokens": 2**70}, {400}, "max_tokens"),
    ("max_tokens_float", C, {"prompt": "hi", "max_tokens": 1.5}, {400}, "max_tokens"),
    ("temperature_nan", C, raw('{"prompt": "hi", "max_tokens": 1, "temperature": NaN}'), {400}, "temperature"),
    (
        "temperature_infinity",
        C,
        raw('{"prompt": "hi", "max_tokens": 1, "temperature": Infinity}'),
        {400},
        "temperature",
    ),
    ("prompt_1mb", C, {"prompt": "lorem ipsum " * 87_382, "max_tokens": 1}, {400}, "prompt"),
    ("prompt_ids_over_context", C, {"prompt": [1] * 100_000, "max_tokens": 1}, {400}, "prompt"),
    ("prompt_ids_out_of_vocab", C, {"prompt": [1, 2, 10**9], "max_tokens": 1}, {400}, "prompt"),
    ("prompt_ids_negative", C, {"prompt": [-1], "max_tokens": 1}, {400}, "prompt"),
    ("prompt_empty", C, {"prompt": "", "max_tokens": 2}, {400}, "prompt"),
    ("prompt_empty_list", C, {"prompt": [], "max_tokens": 2}, {400}, "prompt"),
    ("prompt_list_of_empty", C, {"prompt": ["", "hi"], "max_tokens": 2}, {400}, "prompt"),
    ("prompt_too_many", C, {"prompt": ["hi"] * 10_000, "max_tokens": 1}, {400}, "prompt"),
    (
        "logit_bias_100k_keys",
        C,
        {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(100_000)}},
        {400},
        "logit_bias",
    ),
    ("top_k_vocab_plus_1", C, {"prompt": "hi", "max_tokens": 2, "top_k": 49153}, {400}, "top_k"),
    ("top_k_2_pow_63", CHAT, {"messages": USER, "max_tokens": 2, "top_k": 2**63}, {400}, "top_k"),
    ("top_k_2_pow_70", C, {"prompt": "hi", "max_tokens": 2, "top_k": 2**70}, {400}, "top_k"),
    ("temperature_1e_minus_45", C, {"prompt": "hi", "max_tokens": 2, "temperature": 1e-45}, {200}, None),
    (
        "tool_properties_not_schemas",
        CHAT,
        {"messages": USER, "max_tokens": 2, "tools": [tool({"type": "object", "properties": {"a": 5}})]},
        {400},
        "tools.0.function.parameters",
    ),
    (
        "tool_required_not_a_list",
        CHAT,
        {
            "messages": USER,
            "max_tokens": 2,
            "tools": [tool({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5})],
        },
        {400},
        "tools.0.function.parameters",
    ),
    (
        "tool_forced_bad_schema",
        CHAT,
        {
            "messages": USER,
            "max_tokens": 2,
            "tool_choice": "required",
            "tools": [tool({"type": "object", "properties": [1, 2]})],
        },
        {400},
        "tools.0.function.parameters",
    ),
    (
        "lone_surrogate_70_deep_in_tool",
        CHAT,
        raw(json.dumps({"messages": USER, "max_tokens": 2, "tools": [tool(nested("\ud800", 70))]})),
        {400},
        "tools",
    ),  # json.dumps writes the lone surrogate as a \\ud800 escape
    (
        "responses_tool_not_a_schema",
        RESPONSES,
        {"input": "Hi", "max_output_tokens": 2, "tools": [flat_tool({"type": "object", "properties": {"a": 5}})]},
        {400},
        "tools[0].parameters",
    ),
    (
        "tools_past_limit",
        CHAT,
        {"messages": USER, "max_tokens": 2, "tools": [tool(OBJECT)] * (MAX_TOOLS + 1)},
        {400},
        "tools",
    ),
    (
        "functions_past_limit",
        CHAT,
        {"messages": USER, "max_tokens": 2, "functions": [{"name": "f"}] * (MAX_TOOLS + 1)},
        {400},
        "functions",
    ),
    (
        "messages_past_limit",
        CHAT,
        {"messages": USER * (MAX_MESSAGES + 1), "max_tokens": 2},
        {400},
        ("messages", f"at most {MAX_MESSAGES} are accepted"),
    ),
    (
        "content_parts_past_limit",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]},
        {400},
        "messages",
    ),
    (
        "responses_input_items_past_limit",
        RESPONSES,
        {"input": USER * (MAX_MESSAGES + 1)},
        {400},
        ("input", f"at most {MAX_MESSAGES} are accepted"),
    ),
    (
        "responses_content_parts_past_limit",
        RESPONSES,
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]},
        {400},
        "input",
    ),
    (
        "responses_tools_past_limit",
        RESPONSES,
        {"input": "Hi", "tools": [flat_tool(OBJECT)] * (MAX_TOOLS + 1)},
        {400},
        "tools",
    ),
    ("tokenize_messages_past_limit", "/tokenize", {"messages": USER * (MAX_MESSAGES + 1)}, {400}, "messages"),
    ("prompt_list_of_bools", C, {"prompt": [True, False], "max_tokens": 2}, {400}, "prompt"),
    ("max_tokens_true", C, {"prompt": "hi", "max_tokens": True}, {400}, "max_tokens"),
    ("n_as_string", C, {"prompt": "hi", "max_tokens": 1, "n": "2"}, {400}, "n"),
    ("temperature_as_string", CHAT, {"messages": USER, "max_tokens": 1, "temperature": "0.5"}, {400}, "temperature"),
    ("body_not_object", C, b'["prompt", "hi"]', {400}, "object"),
    ("body_empty", C, b"", {400}, "body"),
]


def post(url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=120)
    return httpx.post(url, json=body, timeout=120)


@pytest.mark.parametrize("name,path,body,statuses,names", CASES, ids=[c[0] for c in CASES])
def test_hostile_input(server, name, path, body, statuses, names):
    t0 = time.monotonic()
    r = post(server.url + path, body)
    elapsed = time.monotonic() - t0
    assert r.status_code in statuses, f"{name}: {r.status_code} {r.text[:1000]}"
    assert elapsed < 60, f"{name} took {elapsed:.1f} s"
    data = r.json()
    if r.status_code == 200:
        assert data["choices"] and all(
            isinstance(c.get("text", c.get("message")), (str, dict)) for c in data["choices"]
        )
        assert data["usage"]["completion_tokens"] >= 1
        return
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if isinstance(names, tuple):
        assert err["param"] == names[0] and names[1] in err["message"], f"{name}: {err}"
    else:
        assert names in (err["param"] or "") or names.lower() in err["message"].lower(), f"{name}: {err}"
    assert "internal error" not in err["message"]


@pytest.mark.parametrize("path,key", [(C, "prompt"), (CHAT, "messages")])
def test_max_tokens_at_and_past_the_context(small_server, llm, path, key):
    """max_tokens that exactly fills the context is served; one more is a 400 naming max_tokens."""
    body = {key: "hi" if key == "prompt" else USER, "ignore_eos": True}
    r = httpx.post(small_server.url + path, json={**body, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    left = SMALL_CONTEXT - prompt_tokens
    name = "max_tokens" if key == "prompt" else "max_completion_tokens"
    r = httpx.post(small_server.url + path, json={**body, name: left}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == left
    r = httpx.post(small_server.url + path, json={**body, name: left + 1}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["code"] == "context_length_exceeded", err


def test_the_server_keeps_serving_after_hostile_inputs(server, llm):
    for _, path, body, _, _ in CASES[:20]:
        post(server.url + path, body)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 15
    while (llm.engine.num_unfinished_requests or free_blocks(llm) != server.baseline) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert llm.engine.num_unfinished_requests == 0
    assert free_blocks(llm) == server.baseline


# ------------------------------------------------------------------------------------------ huge lists beside /health


def health_latencies_during(url: str, path: str, body: dict) -> tuple[httpx.Response, float, list[float]]:
    """POST `body` (encoded before the clock starts) while /health is asked every 50 ms on another connection:
    (the answer, seconds it took, each /health's latency)."""
    payload = json.dumps(body).encode()
    latencies, done = [], threading.Event()

    def poll():
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                t0 = time.monotonic()
                assert client.get(f"{url}/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                done.wait(0.05)

    with ThreadPoolExecutor(1) as pool:
        poller = pool.submit(poll)
        time.sleep(0.2)
        t0 = time.monotonic()
        r = httpx.post(url + path, content=payload, headers={"content-type": "application/json"}, timeout=120)
        took = time.monotonic() - t0
        time.sleep(0.1)
        done.set()
        poller.result()
    return r, took, latencies


HUGE_LISTS = [
    ("chat_50k_tools", CHAT, {"messages": USER, "max_tokens": 2, "tools": [tool(OBJECT)] * 50_000}, "tools"),
    ("responses_50k_tools", RESPONSES, {"input": "Hi", "tools": [flat_tool(OBJECT)] * 50_000}, "tools"),
    ("chat_200k_messages", CHAT, {"messages": USER * 200_000, "max_tokens": 2}, "messages"),
    ("responses_200k_input_items", RESPONSES, {"input": USER * 200_000}, "input"),
]


@pytest.mark.parametrize("name,path,body,field", HUGE_LISTS, ids=[c[0] for c in HUGE_LISTS])
def test_huge_lists_are_refused_naming_the_field_at_once_while_health_answers(server, name, path, body, field):
    """Refused on the count, before any item is validated, rendered or checked against a metaschema (50,000 tools
    held the event loop for 10-20 s; 200,000 messages took 9-13 s to refuse)."""
    r, took, health = health_latencies_during(server.url, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:500]
    assert f"at most {MAX_TOOLS if 'tools' in name else MAX_MESSAGES}" in r.json()["error"]["message"]
    assert took < 3.0, f"{name}: refused after {took:.1f} s"
    assert max(health) < 1.0, f"{name}: /health took up to {max(health):.2f} s"


def test_tool_schemas_within_the_limit_are_checked_off_the_event_loop(server):
    """128 tools of 100 properties each: seconds of metaschema checks, which used to run inside the body's
    validation on the event loop; now on a pool of their own, so /health answers throughout. (The prompt they
    make is then too long for the context: a 400 naming messages.)"""
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "a field"} for i in range(100)},
        "required": ["p0"],
    }
    body = {"messages": USER, "max_tokens": 2, "tools": [tool(schema)] * MAX_TOOLS}
    r, took, health = health_latencies_during(server.url, CHAT, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:500]
    assert took > 0.5  # the checks ran: long enough that /health would have waited on the event loop
    assert max(health) < 1.0, f"/health took up to {max(health):.2f} s while the schemas were checked ({took:.1f} s)"


def test_cache_salt_isolates_responses_as_it_does_chat(server):
    """/v1/responses takes cache_salt: the same input under another salt finds none of its prefix-cache blocks;
    under the same salt it does."""
    text = "Write one word about seabirds. " * 12

    def cached(salt: str) -> int:
        r = httpx.post(
            f"{server.url}{RESPONSES}",
            json={"input": text, "max_output_tokens": 1, "cache_salt": salt, "store": False},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"]

    cached("tenant-a")
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    r = httpx.post(f"{server.url}{RESPONSES}", json={"input": text, "cache_salt": "x" * 513}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
