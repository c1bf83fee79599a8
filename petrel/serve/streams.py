"""Request plumbing shared by the endpoints: the server's state, SSE framing, merged streams, and aborting
requests whose client went away."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from petrel.outputs import OutputChunk
from petrel.serve.chat_template import ChatTemplate
from petrel.serve.errors import APIError
from petrel.serve.limits import HeapTrimmer
from petrel.serve.logprobs import TokenText
from petrel.serve.media import MediaLimits
from petrel.serve.media_fetch import MediaFetcher
from petrel.serve.metrics import ServerMetrics
from petrel.serve.params import ServerLimits
from petrel.serve.tool_schemas import check_tool_schemas, has_tool_schemas

TOKENIZE_THREADS = 2
SCHEMA_THREADS = 2  # tool schemas checked against their metaschema (tool_schemas.py)


@dataclass
class ServeState:
    llm: object
    model_name: str
    limits: ServerLimits
    template: ChatTemplate
    metrics: ServerMetrics
    token_text: TokenText
    api_key: str | None = None
    health_timeout: float = 5.0
    max_pending: int | None = None  # most sequences in flight (running + queued); past it: 429
    created: int = field(default_factory=lambda: int(time.time()))
    lora_modules: dict = field(
        default_factory=dict
    )  # served name -> petrel.LoRARequest (`petrel serve --lora-modules`)
    media: MediaLimits = field(default_factory=MediaLimits)  # image_url parts (petrel/serve/media.py)
    media_fetcher: MediaFetcher = field(default_factory=MediaFetcher)  # their http(s) URLs, on a pool of its own
    trimmer: HeapTrimmer = field(default_factory=HeapTrimmer)  # hands memory a large request freed back to the OS
    # rendering and tokenizing prompts: off the event loop, and off the default executor that /health uses
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="petrel-tokenize")
    )

    # checking tool schemas (slow for big ones): off the event loop, and off the tokenize pool every prompt needs
    schema_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(SCHEMA_THREADS, thread_name_prefix="petrel-schemas")
    )

    # decoding and processing images and videos: one thread of its own, so a 36-megapixel decode holds no prompt
    # behind it, and the memory it frees stays in one malloc arena (what a heap trim cannot hand back is the top
    # of each arena that held it: up to 64 MiB per thread that decoded a large image)
    media_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="petrel-media")
    )

    async def run_blocking(self, fn, *args):
        """fn(*args) on the tokenize pool (CPU work that would otherwise stall every other client)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    async def check_schemas(self, req) -> None:
        """The chat request's tool schemas checked against their metaschema on the schema pool (APIError naming
        the first bad one); nothing to wait for without tools."""
        if has_tool_schemas(req):
            await asyncio.get_running_loop().run_in_executor(self.schema_pool, check_tool_schemas, req)

    async def run_media(self, fn, *args):
        """fn(*args) on the media pool (decoding and processing images and videos)."""
        return await asyncio.get_running_loop().run_in_executor(self.media_pool, fn, *args)

    def check_capacity(self, num_new: int = 1) -> None:
        """Refuse new work with 429 rather than queue without bound. Counts sequences (a request with n=8 is 8):
        `num_new` is the sequences the new request would run."""
        if self.max_pending is None:
            return
        pending = self.llm.engine.num_unfinished_sequences
        if pending + num_new > self.max_pending:
            self.llm.engine.events.rejected()
            raise APIError(
                f"the server is full ({pending} sequences in flight, this request adds {num_new}, limit "
                f"{self.max_pending}); retry later",
                429,
                code="server_overloaded",
            )

    def check_model(self, model: str | None):
        """The LoRARequest the `model` field names (None: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        served = ", ".join(f"`{n}`" for n in [self.model_name, *self.lora_modules])
        raise APIError(
            f"The model `{model}` does not exist. This server serves {served}.",
            404,
            param="model",
            code="model_not_found",
        )

    def response_model(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name when the request chose one, else the base model's."""
        return model if model in self.lora_modules else self.model_name

    def generate_async(self, ids, params, streaming: bool, cache_salt, lora_request, **options):
        if lora_request is not None:
            options["lora_request"] = lora_request
        return self.llm.generate_async(ids, params, streaming=streaming, cache_salt=cache_salt, **options)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def sse(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def abort_unfinished(futures) -> None:
    for f in futures:
        if not f.done():
            f.abort()


async def merged(futures) -> AsyncIterator[tuple[int, OutputChunk]]:
    """(prompt index, OutputChunk) from several streaming futures as they are processed, here on the event loop
    (the futures keep no text or logprobs of their own: the events are built from the chunks). An engine error
    ends the stream with RuntimeError; leaving the loop early (client gone, error) aborts the requests that are
    still running."""
    if len(futures) == 1:  # one request (every chat, most completions): no merging
        try:
            async with aclosing(_chunks(futures[0])) as chunks:
                async for chunk in chunks:
                    yield 0, chunk
        finally:
            abort_unfinished(futures)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, future):
        try:
            async for chunk in _chunks(future):
                queue.put_nowait((i, chunk, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, exc))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, f)) for i, f in enumerate(futures)]
    remaining = len(tasks)
    try:
        while remaining:
            i, chunk, exc = await queue.get()
            if exc is not None:
                raise exc
            if chunk is None:
                remaining -= 1
                continue
            yield i, chunk
    finally:
        abort_unfinished(futures)
        for t in tasks:
            t.cancel()


async def _chunks(future) -> AsyncIterator[OutputChunk]:
    async with aclosing(future.output_chunks_async(keep_history=False)) as chunks:
        async for chunk in chunks:
            if chunk.error is not None:
                raise RuntimeError(f"request {future.request_id} failed: {chunk.error}")
            yield chunk


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


async def wait_all_or_abort(request: Request, futures) -> list:
    """Await every future; if the client disconnects first, abort them all (freeing their KV blocks)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    work = asyncio.ensure_future(asyncio.gather(*(_await(f) for f in futures)))
    try:
        done, _ = await asyncio.wait({watcher, work}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        abort_unfinished(futures)


async def outputs_or_none(state: ServeState, request: Request, futures) -> list | None:
    """wait_all_or_abort for an endpoint: None when the client went away first (its requests aborted, and counted
    so; answer 499); an engine error is a 500."""
    try:
        return await wait_all_or_abort(request, futures)
    except ClientGone:
        return None
    except RuntimeError as exc:
        raise APIError(str(exc), 500) from None


async def _await(future):
    return await future
