"""`petrel route --prefill URL --decode URL`: one OpenAI-compatible front over a prefill and a decode server.

Each completion or chat request goes to the prefill server as a context_only request (non-streaming: it
prefills, samples the first token and keeps the prompt's KV pinned), then to the decode server as a
generation_only request carrying the returned disaggregated_params: that server fetches the KV, decodes on, and
its answer (streamed or not) is passed through. It starts with the first token, so the client sees one normal
answer. A request the split cannot serve (n > 1, logprobs, several prompts, guided output: the prefill server
refuses it naming disaggregated_params), or whose first token already ended it, goes whole to the decode server;
so does one the prefill server has no room to pin for (429 naming disaggregated_params).

The two servers run with --kv-transfer-role prefill and decode, the decode one listing the prefill one's KV
transfer endpoint in --kv-transfer-peers, and both with the same --kv-transfer-secret: the fetch between them
authenticates with it, so the router needs no credential of its own beyond the client's API key, which it
passes on to both.
"""

from __future__ import annotations

import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from petrel.route.router import (
    Router,
    _pass_through,
    add_completion_routes,
    forwarded_headers,
    json_body,
    router_base_app,
)
from petrel.serve.errors import APIError
from petrel.serve.limits import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger("petrel.route")

PARAM = "disaggregated_params"


def build_disagg_app(
    prefill_url: str,
    decode_url: str,
    health_interval: float = 2.0,
    timeout: float = 600.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    router = Router([prefill_url, decode_url])
    prefill, decode = router.backends
    app, state = router_base_app(router, "petrel route (disaggregated)", health_interval, timeout, max_request_bytes)

    async def send(backend, path: str, body: dict, headers: dict, stream: bool) -> httpx.Response:
        client: httpx.AsyncClient = state["client"]
        backend.in_flight += 1
        try:
            # json.dumps' ASCII form: a lone surrogate the client escaped stays escaped (httpx's `json=` writes it
            # raw and fails to encode it), NaN goes on for the server to refuse
            payload = json.dumps(body).encode()
            headers = {**headers, "content-type": "application/json"}
            upstream = await client.send(
                client.build_request("POST", backend.url + path, content=payload, headers=headers), stream=stream
            )
        except httpx.HTTPError as exc:
            backend.in_flight -= 1
            router.mark_down(backend, f"{type(exc).__name__}: {exc}")
            raise APIError(
                f"the {'prefill' if backend is prefill else 'decode'} server {backend.url} is unreachable: "
                f"{type(exc).__name__}",
                503,
            ) from None
        backend.served += 1
        if not stream:
            backend.in_flight -= 1
        return upstream

    async def whole_to_decode(path: str, body: dict, headers: dict):
        return _pass_through(await send(decode, path, body, headers, stream=True), decode)

    async def split(request: Request, path: str):
        body = await json_body(request)
        if PARAM in body:
            raise APIError("disaggregated_params is set by the router; send a plain request", 400, param=PARAM)
        headers = forwarded_headers(request)
        context = {k: v for k, v in body.items() if k != "stream_options"}
        context.update(stream=False, disaggregated_params={"request_type": "context_only"})
        answer = await send(prefill, path, context, headers, stream=False)
        if answer.status_code != 200:
            error = _error_param(answer)
            if answer.status_code in (400, 429) and error == PARAM:  # not splittable, or no room to pin now:
                return await whole_to_decode(path, body, headers)  # the decode server does it all
            return JSONResponse(answer.json(), status_code=answer.status_code)
        params = answer.json()["choices"][0].get(PARAM)
        if not params or not params.get("opaque_state"):  # the first token ended it (EOS, stop, max_tokens=1)
            return await whole_to_decode(path, body, headers)
        generation = dict(body, disaggregated_params=dict(params, request_type="generation_only"))
        upstream = await send(decode, path, generation, headers, stream=True)
        response = _pass_through(upstream, decode)
        response.headers["x-petrel-prefill"] = prefill.url
        return response

    add_completion_routes(app, split)

    @app.get("/v1/models")
    async def models(request: Request):
        client: httpx.AsyncClient = state["client"]
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            r = await client.get(decode.url + "/v1/models", headers=headers, timeout=10)
        except httpx.HTTPError as exc:
            raise APIError(f"the decode server is unreachable: {type(exc).__name__}", 503) from None
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/health")
    async def health():
        ok = prefill.healthy and decode.healthy
        body = {"status": "ok" if ok else "unavailable", "prefill": prefill.status(), "decode": decode.status()}
        return JSONResponse(body, status_code=200 if ok else 503)

    return app


def _error_param(answer: httpx.Response) -> str | None:
    try:
        return answer.json()["error"].get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
