"""Request-body limits as ASGI middleware: a body over `max_bytes` is a 413 before any handler parses it, a body
that stalls for `body_timeout` seconds between chunks is a 408 (a slow-POST client cannot hold a request open
forever), and after a large body the memory its request freed is handed back to the OS."""

from __future__ import annotations

import asyncio

from petrel.heap import can_release, collect_and_release
from petrel.serve.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0
TRIM_AFTER_BYTES = 1024 * 1024  # a body this large makes its request free enough memory to hand back


class HeapTrimmer:
    """Hands the heap's free memory back to the OS (glibc's malloc_trim) on a worker thread, at most once per
    `interval` seconds: requests in a burst share one trim, run after the last of them. The garbage collector runs
    first (heap.collect_and_release), so what a refused body's exception still held is handed back too.

    Why: glibc keeps what a large request frees. Once a 10 MB buffer has been freed its mmap threshold rises, so
    later ones come from the heap, which shrinks only from its top: nine 10 MB prompts (refused with a 400) left
    the server's RSS 560 MiB higher for good; a trim gives it all back (900 -> 1461 -> 914 MiB)."""

    def __init__(self, release=None, interval: float = 1.0):
        self.release = (collect_and_release if can_release() else None) if release is None else release
        self.interval = interval
        self._last = float("-inf")
        self._scheduled = False

    def request(self, executor=None) -> None:
        """A trim soon: after the current task step (so the caller's frame and its buffers are gone first), on
        `executor` (None: the loop's default). A pool of one thread that held the buffers runs it after that
        thread has dropped the last job's arguments and result."""
        if self.release is None or self._scheduled:
            return
        loop = asyncio.get_running_loop()
        self._scheduled = True
        loop.call_later(max(0.0, self._last + self.interval - loop.time()), self._run, loop, executor)

    def _run(self, loop, executor=None) -> None:
        self._scheduled, self._last = False, loop.time()
        loop.run_in_executor(executor, self.release)


class BodySizeLimit:
    """Reads the body up to `max_bytes` (refusing a larger Content-Length at once), waiting at most `body_timeout`
    seconds (None: forever) for each chunk, then hands it to the app; later receive() calls go to the client
    connection, so disconnects are still seen. After a body of TRIM_AFTER_BYTES or more, `trimmer` runs."""

    def __init__(
        self,
        app,
        max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
        trimmer: HeapTrimmer | None = None,
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout
        self.trimmer = trimmer or HeapTrimmer()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0
        try:
            body, more = bytearray(), True  # bytes += would copy the whole body per chunk: O(n^2) on the loop
            while more:
                message = await self._next_chunk(receive)
                if message is None:
                    return await self._time_out(scope, receive, send)
                if message["type"] != "http.request":  # the client left while sending
                    return
                body += message.get("body", b"")
                received, more = len(body), message.get("more_body", False)
                if received > self.max_bytes:
                    return await self._refuse(scope, receive, send)
            data = bytes(body)
            del body  # the app holds one copy of the body, not two
            return await self.app(scope, self._replay(data, receive), send)
        finally:
            if received >= TRIM_AFTER_BYTES:
                self.trimmer.request()

    @staticmethod
    def _replay(body: bytes, receive):
        """receive() for the app: the whole body once, then the client connection's messages."""
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    async def _next_chunk(self, receive):
        """The next receive() message, or None when none came within body_timeout."""
        if self.body_timeout is None:
            return await receive()
        try:
            async with asyncio.timeout(self.body_timeout):  # a timer, not a task per chunk as wait_for makes
                return await receive()
        except TimeoutError:
            return None

    async def _refuse(self, scope, receive, send):
        response = APIError(
            f"the request body is larger than this server accepts ({self.max_bytes} bytes)",
            413,
            code="request_too_large",
        ).response()
        await response(scope, receive, send)

    async def _time_out(self, scope, receive, send):
        response = APIError(
            f"the request body stalled: no data for {self.body_timeout:g} s", 408, code="request_timeout"
        ).response()
        response.headers["connection"] = "close"  # the rest of the body is not read: end the connection
        await response(scope, receive, send)
