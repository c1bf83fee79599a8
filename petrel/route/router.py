"""`petrel route`: one OpenAI-compatible front over several petrel servers (data-parallel serving).

Which backend serves a request:
  1. `target_endpoint` (a body field or the `X-Target-Endpoint` header, the URL of one backend) when given;
  2. else the prefix: rendezvous hashing of the prompt's first `prefix_chars` characters (for chat, of the
     messages) picks a preferred backend, so requests that share a prefix meet the same prefix cache;
  3. unless that backend has `max_imbalance` more requests in flight than the least loaded one: then the least
     loaded takes it (load beats locality only when the gap is large).
A backend that refuses the connection, drops it before answering, or answers 503 is marked down and the request
goes to the next one; nothing has reached the client yet, so no request is lost. Once a backend has started
answering, the answer (a stream included) is passed through as it is. A health check every `health_interval`
seconds brings backends back (and marks silent ones down).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from petrel.serve.errors import APIError

logger = logging.getLogger("petrel.route")

# what a backend needs from the client's request headers
_FORWARDED_HEADERS = ("authorization", "content-type", "accept")


@dataclass
class Backend:
    url: str
    healthy: bool = True
    in_flight: int = 0
    served: int = 0              # requests this backend answered
    failures: int = 0            # times a request could not be handed to it
    last_error: str | None = None
    down_since: float | None = field(default=None, repr=False)

    def status(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "served": self.served,
                "failures": self.failures, "last_error": self.last_error}


class Router:
    def __init__(self, urls: list[str], prefix_chars: int = 256, max_imbalance: int = 8):
        if not urls:
            raise ValueError("route needs at least one backend URL")
        self.backends = [Backend(u.rstrip("/")) for u in urls]
        self.prefix_chars = prefix_chars
        self.max_imbalance = max_imbalance

    def backend(self, url: str) -> Backend | None:
        url = url.rstrip("/")
        return next((b for b in self.backends if b.url == url), None)

    def candidates(self, prefix: str, target: str | None = None) -> list[Backend]:
        """Healthy backends in the order to try: the target first, else the prefix's preference (load-capped)."""
        healthy = [b for b in self.backends if b.healthy]
        if target is not None:
            chosen = self.backend(target)
            if chosen is None:
                raise APIError(f"target_endpoint {target!r} is not one of this router's backends "
                               f"({', '.join(b.url for b in self.backends)})", 400, param="target_endpoint")
            return [chosen] + [b for b in healthy if b is not chosen]
        key = prefix[:self.prefix_chars].encode()
        ranked = sorted(healthy, key=lambda b: hashlib.sha256(b.url.encode() + b"\0" + key).digest(), reverse=True)
        if ranked:
            least = min(b.in_flight for b in ranked)
            if ranked[0].in_flight - least > self.max_imbalance:
                ranked.sort(key=lambda b: b.in_flight)    # stable: ties keep the prefix order
        return ranked

    def mark_down(self, backend: Backend, error: str) -> None:
        if backend.healthy:
            logger.warning("backend %s is down: %s", backend.url, error)
        backend.healthy, backend.last_error = False, error
        backend.failures += 1
        backend.down_since = backend.down_since or time.monotonic()

    def mark_up(self, backend: Backend) -> None:
        if not backend.healthy:
            logger.info("backend %s is back", backend.url)
        backend.healthy, backend.down_since = True, None


def prefix_of(body: dict) -> str:
    """The text that decides which prefix cache a request should meet: its prompt, or its messages."""
    if "messages" in body:
        return json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]                       # a batch of prompts: route by the first
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


async def _health_loop(router: Router, client: httpx.AsyncClient, interval: float) -> None:
    while True:
        for backend in router.backends:
            try:
                r = await client.get(f"{backend.url}/health", timeout=max(1.0, interval))
                if r.status_code == 200:
                    router.mark_up(backend)
                else:
                    router.mark_down(backend, f"/health answered {r.status_code}")
            except httpx.HTTPError as exc:
                router.mark_down(backend, f"/health: {type(exc).__name__}")
        await asyncio.sleep(interval)


def router_base_app(router: Router, title: str, health_interval: float, timeout: float) -> tuple[FastAPI, dict]:
    """The app both fronts build on: for its lifetime one pooled HTTP client (state["client"]) and the health loop
    over the router's backends; API errors answered as OpenAI-style JSON."""
    state = {}

    @asynccontextmanager
    async def lifespan(app):
        client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), trust_env=False,
                                   limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        state["client"] = client
        checker = asyncio.create_task(_health_loop(router, client, health_interval))
        try:
            yield
        finally:
            checker.cancel()
            await client.aclose()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    return app, state


def add_completion_routes(app: FastAPI, handle) -> None:
    """POST /v1/completions and /v1/chat/completions, each answered by `await handle(request, path)`."""
    def endpoint_for(path: str):
        async def endpoint(request: Request):
            return await handle(request, path)
        return endpoint

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, endpoint_for(path), methods=["POST"])


def build_router_app(router: Router, health_interval: float = 2.0, timeout: float = 600.0) -> FastAPI:
    app, state = router_base_app(router, "petrel route", health_interval, timeout)

    async def forward(request: Request, path: str):
        body = await json_body(request)
        target = body.pop("target_endpoint", None) or request.headers.get("x-target-endpoint")
        payload = json.dumps(body).encode()
        headers = forwarded_headers(request)
        client: httpx.AsyncClient = state["client"]
        tried = []
        for backend in router.candidates(prefix_of(body), target):
            tried.append(backend.url)
            backend.in_flight += 1
            try:
                upstream = await client.send(client.build_request("POST", backend.url + path, content=payload,
                                                                  headers=headers), stream=True)
            except httpx.HTTPError as exc:        # refused, reset, or dropped before any answer
                backend.in_flight -= 1
                router.mark_down(backend, f"{type(exc).__name__}: {exc}")
                continue
            if upstream.status_code == 503:       # its engine is gone or stuck: try the next one
                await upstream.aclose()
                backend.in_flight -= 1
                router.mark_down(backend, "answered 503")
                continue
            backend.served += 1
            return _pass_through(upstream, backend)
        raise APIError(f"no backend could take the request (tried: {', '.join(tried) or 'none healthy'})", 503)

    add_completion_routes(app, forward)

    @app.get("/v1/models")
    async def models(request: Request):
        client: httpx.AsyncClient = state["client"]
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        seen = {}
        status = 503
        for backend in [b for b in router.backends if b.healthy]:
            try:
                r = await client.get(backend.url + "/v1/models", headers=headers, timeout=10)
            except httpx.HTTPError as exc:
                router.mark_down(backend, f"{type(exc).__name__}: {exc}")
                continue
            if r.status_code != 200:
                return JSONResponse(r.json(), status_code=r.status_code)
            status = 200
            for model in r.json().get("data", []):
                seen.setdefault(model["id"], model)
        if status != 200:
            raise APIError("no backend is healthy", 503)
        return {"object": "list", "data": list(seen.values())}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if any(b.healthy for b in router.backends) else "unavailable",
                "backends": [b.status() for b in router.backends]}
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    return app


async def json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("the request body is not valid JSON", 400) from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400)
    return body


def forwarded_headers(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}


def _pass_through(upstream: httpx.Response, backend: Backend) -> Response:
    """The backend's answer as it comes: status, content type and body (streamed for SSE)."""
    async def body():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:   # the backend died mid-answer: the client sees the stream end
            logger.warning("backend %s dropped an answer mid-way: %s", backend.url, exc)
        finally:
            await upstream.aclose()
            backend.in_flight -= 1
    headers = {"content-type": upstream.headers.get("content-type", "application/json"),
               "x-petrel-backend": backend.url}
    return StreamingResponse(body(), status_code=upstream.status_code, headers=headers)
