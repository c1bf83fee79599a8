"""Request-size limit as ASGI middleware: a body over `max_bytes` is a 413 before any handler parses it."""
from __future__ import annotations

from petrel.serve.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


class BodySizeLimit:
    """Reads the body up to `max_bytes` (refusing a larger Content-Length at once), then hands it to the app;
    later receive() calls go to the client connection, so disconnects are still seen."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":     # the client left while sending
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = APIError(f"the request body is larger than this server accepts ({self.max_bytes} bytes)", 413,
                            code="request_too_large").response()
        await response(scope, receive, send)
