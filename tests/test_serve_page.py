"""The chat page at GET /: plain files from petrel/serve/static, public even when the API needs a key."""

from __future__ import annotations

import json

import httpx
import pytest

from petrel.serve import build_app
from petrel.serve.server import BackgroundServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(build_app(llm)) as srv:
        yield srv


def test_page_is_html_and_names_its_endpoints(server):
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<title>petrel chat</title>" in page
    assert "/static/app.js" in page and "/static/style.css" in page
    js = httpx.get(f"{server.url}/static/app.js").text
    for endpoint in ("/v1/models", "/v1/chat/completions"):
        assert endpoint in js
    assert "stream: true" in js and "AbortController" in js and "[DONE]" in js and "localStorage" in js


def test_assets_are_served(server):
    js = httpx.get(f"{server.url}/static/app.js")
    css = httpx.get(f"{server.url}/static/style.css")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert httpx.get(f"{server.url}/static/nope.js").status_code == 404


def test_page_is_not_in_the_api_schema(server):
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/static") for p in paths)


def test_page_is_public_when_the_api_needs_a_key(llm):
    with BackgroundServer(build_app(llm, api_key="s3cret")) as srv:
        assert httpx.get(f"{srv.url}/").status_code == 200
        assert httpx.get(f"{srv.url}/static/app.js").status_code == 200
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        ok = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"]


def test_the_request_the_page_sends_streams_content_then_usage(server):
    """The body app.js posts: SSE `data:` lines of chunks, a usage chunk (for tokens/s), then [DONE]."""
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.7,
        "max_tokens": 4,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text and events[-1]["usage"]["completion_tokens"] <= 4
