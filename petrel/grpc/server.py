"""The gRPC worker's server: a grpc.aio server for one servicer (TrtllmServicer or VllmServicer) on its own event
loop in a daemon thread, beside (or instead of) the HTTP server, over the same LLM.

It listens where the HTTP server does (`--host`, loopback by default), without TLS, and with an API key takes
only calls that carry it (petrel/grpc/auth.py). A request message may be as large as an HTTP request body
(`--max-request-bytes`); responses (prompt logprobs, logits) up to MAX_SEND_BYTES."""

from __future__ import annotations

import asyncio
import threading

from petrel.serve.limits import DEFAULT_MAX_REQUEST_BYTES

MAX_SEND_BYTES = 256 * 1024 * 1024  # a long prompt's ids, prompt logprobs, logits


class GrpcServer:
    """`GrpcServer(servicer, host, port).start()` listens (port 0: one the OS picks, then `self.port`).
    api_key: calls without metadata `authorization: Bearer <api_key>` are UNAUTHENTICATED (HealthCheck excepted).
    max_request_bytes: a larger request message is refused (RESOURCE_EXHAUSTED) before it is parsed."""

    def __init__(
        self,
        servicer,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        self.servicer = servicer
        self.host = host
        self.port = port
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="petrel-grpc", daemon=True)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def _start(self) -> int:
        import grpc

        from petrel.grpc.auth import ApiKeyInterceptor

        options = [
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.max_receive_message_length", self.max_request_bytes),
        ]
        interceptors = [ApiKeyInterceptor(self.api_key)] if self.api_key else []
        self._server = grpc.aio.server(options=options, interceptors=interceptors)
        self.servicer.add_to_server(self._server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = self._server.add_insecure_port(f"{host}:{self.port}")
        await self._server.start()
        return port

    async def _stop(self, grace: float) -> None:
        self.servicer.close()  # requests still being prepared end now, not after the grace period
        await self._server.stop(grace)

    def start(self) -> GrpcServer:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving (requests in flight get `grace` seconds); a second call does nothing."""
        if not self._loop.is_running():
            return
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop).result(timeout=grace + 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def wait(self) -> None:
        """Block until the server stopped (a `petrel serve --grpc-port` without the HTTP server)."""
        asyncio.run_coroutine_threadsafe(self._server.wait_for_termination(), self._loop).result()

    def __enter__(self) -> GrpcServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
