"""`petrel route`: one OpenAI-compatible front over several petrel servers (data-parallel serving).

Which backend serves a request:
  1. `target_endpoint` (a body field or the `X-Target-Endpoint` header, the URL of one backend) when given;
  2. else the prefix: rendezvous hashing of the prompt's first `prefix_chars` characters (for chat, of the
     messages) picks a preferred backend, so requests that share a prefix meet the same prefix cache;
  3. unless that backend has `max_imbalance` more requests in flight than the least loaded one: then the least
     loaded takes it (load beats locality only when the gap is large).
A backend that refuses the connection, drops it before answering, answers 503, or goes silent (see below) is
marked down and the request goes to the next one; nothing has reached the client yet, so no request is lost. Once a
backend has started answering, the answer (a stream included) is passed through as it is; a stream that breaks off
mid-way (the backend died or went silent) ends with an error event and `data: [DONE]`, as one the server ends itself.
A health check of each backend every `health_interval` seconds brings backends back (and marks silent ones down).

A backend is silent when nothing at all has come from it, neither a byte of the answer being waited for nor a reply
to a health check, for `backend_timeout` seconds (a stopped or wedged process). A busy backend still answers its
health checks, so a long non-streamed generation, whose answer only comes at its end, or a request queued behind
others is never cut short by it; `timeout` bounds the wait for any one byte regardless. A client that hangs up
while its request is being answered makes the router close the backend's connection, so the backend aborts the
request and frees its KV cache. Request bodies over `max_request_bytes` are refused (413) before any is read.
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
from petrel.serve.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit

logger = logging.getLogger("petrel.route")

# what a backend needs from the client's request headers
_FORWARDED_HEADERS = ("authorization", "content-type", "accept")

DEFAULT_BACKEND_TIMEOUT = 30.0  # seconds a backend may be silent (not even answering /health) before it is given up


class BackendSilent(Exception):
    """Nothing came from a backend (no byte of the answer, no health-check reply) for the backend timeout."""


class ClientGone(Exception):
    """The client closed its connection while its request was being answered."""


@dataclass
class Backend:
    url: str
    healthy: bool = True
    in_flight: int = 0
    served: int = 0  # requests this backend answered
    failures: int = 0  # times a request could not be handed to it
    last_error: str | None = None
    down_since: float | None = field(default=None, repr=False)
    last_heard: float = field(default_factory=time.monotonic, repr=False)  # its last reply of any kind

    def status(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
        }


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
                raise APIError(
                    f"target_endpoint {_shown(target)} is not one of this router's backends "
                    f"({', '.join(b.url for b in self.backends)})",
                    400,
                    param="target_endpoint",
                )
            return [chosen] + [b for b in healthy if b is not chosen]
        key = prefix[: self.prefix_chars].encode("utf-8", "surrogatepass")  # JSON may hold a lone surrogate
        ranked = sorted(healthy, key=lambda b: hashlib.sha256(b.url.encode() + b"\0" + key).digest(), reverse=True)
        if ranked:
            least = min(b.in_flight for b in ranked)
            if ranked[0].in_flight - least > self.max_imbalance:
                ranked.sort(key=lambda b: b.in_flight)  # stable: ties keep the prefix order
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
    """The text that decides which prefix cache a request should meet: its prompt_cache_key (OpenAI's name for
    requests that should share a cache), else its prompt, or its messages."""
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return f"\0prompt_cache_key\0{key}"
    if "messages" in body:
        return json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: route by the first
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


async def _health_loop(router: Router, client: httpx.AsyncClient, interval: float) -> None:
    """Each backend checked on its own schedule, so one that never answers does not delay the others' checks."""
    await asyncio.gather(*(_check_health(router, backend, client, interval) for backend in router.backends))


async def _check_health(router: Router, backend: Backend, client: httpx.AsyncClient, interval: float) -> None:
    while True:
        try:
            r = await client.get(f"{backend.url}/health", timeout=max(1.0, interval))
            backend.last_heard = time.monotonic()  # any reply: the process is alive, if perhaps unhealthy
            if r.status_code == 200:
                router.mark_up(backend)
            else:
                router.mark_down(backend, f"/health answered {r.status_code}")
        except httpx.HTTPError as exc:
            router.mark_down(backend, f"/health: {type(exc).__name__}")
        await asyncio.sleep(interval)


def check_backend_timeout(backend_timeout: float, health_interval: float) -> None:
    """A busy backend proves it is alive through its health checks, each up to max(1, interval) seconds apart plus
    as long again to answer: a backend timeout shorter than 3 of those would give up on healthy backends."""
    least = 3 * max(1.0, health_interval)
    if not backend_timeout >= least:
        raise ValueError(
            f"backend_timeout ({backend_timeout} s) must be at least 3 x max(1, health_interval) = "
            f"{least:g} s, or a busy backend could be taken for a silent one"
        )


def router_base_app(
    router: Router,
    title: str,
    health_interval: float,
    timeout: float,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> tuple[FastAPI, dict]:
    """The app both fronts build on: for its lifetime one pooled HTTP client (state["client"]; `timeout` bounds the
    wait for any one byte from a backend) and the health loop over the router's backends; API errors answered as
    OpenAI-style JSON; request bodies over `max_request_bytes` refused with 413."""
    if not (isinstance(max_request_bytes, int) and max_request_bytes > 0):
        raise ValueError(f"max_request_bytes must be a positive number of bytes, not {max_request_bytes!r}")
    state = {}

    @asynccontextmanager
    async def lifespan(app):
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=5.0),
            trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        state["client"] = client
        checker = asyncio.create_task(_health_loop(router, client, health_interval))
        try:
            yield
        finally:
            checker.cancel()
            await client.aclose()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.router = router
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

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


def build_router_app(
    router: Router,
    health_interval: float = 2.0,
    timeout: float = 600.0,
    backend_timeout: float = DEFAULT_BACKEND_TIMEOUT,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    check_backend_timeout(backend_timeout, health_interval)
    app, state = router_base_app(router, "petrel route", health_interval, timeout, max_request_bytes)

    async def forward(request: Request, path: str):
        body = await json_body(request)
        target = target_endpoint(body, request.headers)
        exchange = _Exchange(
            state["client"],
            path,
            json.dumps(body).encode(),
            forwarded_headers(request),
            backend_timeout,
            asyncio.ensure_future(client_disconnected(request)),
        )
        tried, silent = [], []
        try:
            for backend in router.candidates(prefix_of(body), target):
                tried.append(backend.url)
                try:
                    return await exchange.ask(backend)
                except BackendSilent as exc:
                    silent.append(f"{backend.url} {exc}")
                    router.mark_down(backend, str(exc))
                except _Unanswered as exc:
                    router.mark_down(backend, str(exc))
        except ClientGone:
            return Response(status_code=499)  # nobody to answer; the backend was told by the closed connection
        finally:
            exchange.client_gone.cancel()
        if silent:
            raise APIError(
                f"no backend answered in time: {'; '.join(silent)} (tried: {', '.join(tried)})",
                504,
                code="backend_timeout",
                type="server_error",
            )
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
        body = {
            "status": "ok" if any(b.healthy for b in router.backends) else "unavailable",
            "backends": [b.status() for b in router.backends],
        }
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    return app


async def json_body(request: Request) -> dict:
    """The request's JSON object; anything else is a 400 (an integer of more digits than Python converts, arrays
    nested past the recursion limit: JSON the router cannot read, answered as such, not as a 500)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError, RecursionError):  # JSONDecodeError is a ValueError
        raise APIError("the request body is not valid JSON", 400) from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400)
    return body


def target_endpoint(body: dict, headers) -> str | None:
    """The backend URL the client asked for, taken out of the body: its `target_endpoint` (null counts as absent),
    else the X-Target-Endpoint header. Anything but a non-empty string is a 400 naming target_endpoint (an unknown
    URL is one too, from Router.candidates)."""
    value = body.pop("target_endpoint", None)
    where = "target_endpoint"
    if value is None:
        value, where = headers.get("x-target-endpoint"), "the X-Target-Endpoint header"
        if value is None:
            return None
    if not isinstance(value, str) or not value.strip():
        raise APIError(
            f"target_endpoint must be the URL of one of this router's backends, a non-empty string; "
            f"{where} is {_shown(value)}",
            400,
            param="target_endpoint",
        )
    return value.strip()


def _shown(value) -> str:
    """A client's value for an error message, quoted and cut short; escaped where it is no text the answer's UTF-8
    can hold (a lone surrogate: repr escapes it in a string, JSON's ASCII form anywhere else)."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def forwarded_headers(request: Request) -> dict:
    return {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}


async def client_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (its body has been read, so receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Unanswered(Exception):
    """A backend did not answer (refused, dropped the connection, answered 503): the next one may."""


class _Exchange:
    """One client request as sent to a backend: `ask` returns the response to give the client, or raises
    _Unanswered / BackendSilent (try the next backend) or ClientGone (the client hung up meanwhile)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        path: str,
        payload: bytes,
        headers: dict,
        silence: float,
        client_gone: asyncio.Future,
    ):
        self.client, self.path, self.payload, self.headers = client, path, payload, headers
        self.silence, self.client_gone = silence, client_gone

    async def ask(self, backend: Backend) -> Response:
        backend.in_flight += 1
        try:
            upstream = await self._send(backend)
        except BaseException:
            backend.in_flight -= 1
            raise
        if is_event_stream(upstream):
            backend.served += 1
            return _pass_through(upstream, backend, self.silence)  # in_flight is given back when the stream ends
        try:
            content = await heard_from(upstream.aread(), backend, self.silence, self.client_gone)
        except httpx.HTTPError as exc:  # dropped mid-body: nothing has reached the client yet
            raise _Unanswered(f"{type(exc).__name__}: {exc}") from None
        finally:
            await upstream.aclose()
            backend.in_flight -= 1
        backend.served += 1
        return Response(content, status_code=upstream.status_code, headers=answer_headers(upstream, backend))

    async def _send(self, backend: Backend) -> httpx.Response:
        """The backend's response, headers read (for a non-streamed request they come with the whole answer)."""
        request = self.client.build_request("POST", backend.url + self.path, content=self.payload, headers=self.headers)
        try:
            upstream = await heard_from(self.client.send(request, stream=True), backend, self.silence, self.client_gone)
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise _Unanswered(f"{type(exc).__name__}: {exc}") from None
            raise BackendSilent(f"sent nothing within the router's read timeout ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:  # refused, reset, or dropped before any answer
            raise _Unanswered(f"{type(exc).__name__}: {exc}") from None
        if upstream.status_code == 503:  # its engine is gone or stuck: try the next one
            await upstream.aclose()
            raise _Unanswered("answered 503")
        return upstream


async def heard_from(step, backend: Backend, silence: float | None, client_gone: asyncio.Future | None = None):
    """Await one step of an exchange with `backend` (its response, the next chunk). Raises BackendSilent when
    nothing at all has come from the backend (this step's bytes, any health-check reply) for `silence` seconds
    since the step began, and ClientGone when `client_gone` finishes first. Either way the step is cancelled, which
    closes its connection: the backend sees the disconnect and aborts the request."""
    task = asyncio.ensure_future(step)
    waiting = {task} if client_gone is None else {task, client_gone}
    began = time.monotonic()
    try:
        while True:
            left = None if silence is None else max(began, backend.last_heard) + silence - time.monotonic()
            if left is not None and left <= 0:
                raise BackendSilent(f"sent nothing, not even a health-check reply, for {silence:g} s")
            done, _ = await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                backend.last_heard = time.monotonic()
                return task.result()
            if client_gone is not None and client_gone in done:
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


def is_event_stream(upstream: httpx.Response) -> bool:
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


def answer_headers(upstream: httpx.Response, backend: Backend) -> dict:
    return {"content-type": upstream.headers.get("content-type", "application/json"), "x-petrel-backend": backend.url}


def _pass_through(upstream: httpx.Response, backend: Backend, silence: float | None = None) -> Response:
    """The backend's answer as it comes: status, content type and body, streamed. An event stream goes on in whole
    events; if it breaks off before its `data: [DONE]` (the backend died, or sent nothing for `silence` seconds
    while not answering its health checks either), it ends with an error event and `data: [DONE]`, as a stream the
    server itself cuts short does, never with a half event or a bare end."""
    events = is_event_stream(upstream)

    async def body():
        chunks, pending, done_sent = upstream.aiter_bytes(), b"", False
        try:
            while (chunk := await heard_from(_next_chunk(chunks), backend, silence)) is not None:
                if not events:
                    yield chunk
                    continue
                whole, pending = _whole_events(pending + chunk)
                if whole:
                    done_sent = done_sent or _SSE_DONE in whole
                    yield whole
            if pending:
                yield pending
        except (httpx.HTTPError, BackendSilent) as exc:
            logger.warning("backend %s broke off an answer mid-way: %s: %s", backend.url, type(exc).__name__, exc)
            if events and not done_sent:
                yield _stream_error_events(backend, exc)
        finally:
            await upstream.aclose()
            backend.in_flight -= 1

    return StreamingResponse(body(), status_code=upstream.status_code, headers=answer_headers(upstream, backend))


_SSE_DONE = b"data: [DONE]"


async def _next_chunk(chunks) -> bytes | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _whole_events(data: bytes) -> tuple[bytes, bytes]:
    """(the complete SSE events at the start of `data`, the unfinished rest)."""
    end = data.rfind(b"\n\n") + 2
    return (data[:end], data[end:]) if end >= 2 else (b"", data)


def _stream_error_events(backend: Backend, exc: Exception) -> bytes:
    if isinstance(exc, BackendSilent):
        error = APIError(
            f"the backend {backend.url} {exc}; the answer is cut short",
            504,
            code="backend_timeout",
            type="server_error",
        )
    else:
        error = APIError(
            f"the backend {backend.url} broke off the answer ({type(exc).__name__}); it is cut short",
            502,
            code="backend_disconnected",
        )
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n" + _SSE_DONE + b"\n\n"
