"""What every request the engine serves reports on its caller's side, whatever its front: the HTTP server's
endpoints, the gRPC worker's services, the LLM API called in the same process. /metrics counts from here.

The engine has one RequestEvents (LLMEngine.events). A RequestFuture (petrel/request_future.py) reports its request
once: `finished` when its caller has processed its last output, with its finish reasons, token counts and times
(RequestPerfMetrics); or `aborted` when its caller gives up on it first (RequestFuture.abort before its end: an
HTTP client gone, a gRPC call cancelled or an Abort RPC, a caller's own abort). A front reports `rejected` when it
refuses a request because the server is full. The disaggregated KV transfer (petrel/disagg/) reports each prompt's
KV handed off to a decode instance and fetched from a prefill one, and each that failed.

Listeners (petrel/serve/metrics.py ServerMetrics) are held weakly, so an app that is gone stops listening. Events
come from any thread; a listener that raises is logged and the request goes on. A request nobody waits on reports
nothing until someone does (its outputs are processed then).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from petrel.outputs import RequestPerfMetrics

logger = logging.getLogger("petrel")


@dataclass(frozen=True)
class FinishedRequest:
    """One request at its end, as its caller saw it."""

    finish_reasons: tuple[str, ...]  # per sequence: stop | length | timeout | cancelled
    prompt_tokens: int
    generated_tokens: int  # every sequence's output tokens
    perf: RequestPerfMetrics  # arrival, first and last token times
    error: str | None = None  # the message of an abort that is an error (engine or output-processing failure)


class RequestEvents:
    """The engine's listeners of request events; `listen(listener)` adds one (held weakly). A listener has the
    methods request_finished(FinishedRequest), request_aborted(), request_rejected(), kv_handed_off(num_bytes,
    seconds), kv_handoff_failed(), kv_fetched(num_bytes, seconds), kv_fetch_failed()."""

    def __init__(self):
        self._lock = threading.Lock()
        self._listeners: tuple[weakref.ref, ...] = ()  # replaced whole under the lock, read without it

    def listen(self, listener) -> None:
        with self._lock:
            alive = tuple(ref for ref in self._listeners if ref() is not None)
            self._listeners = (*alive, weakref.ref(listener))

    def _emit(self, name: str, *args) -> None:
        for ref in self._listeners:
            listener = ref()
            if listener is None:
                continue
            try:
                getattr(listener, name)(*args)
            except Exception:  # noqa: BLE001 - counting a request never fails it
                logger.exception("a request-event listener failed on %s", name)

    def finished(self, request: FinishedRequest) -> None:
        self._emit("request_finished", request)

    def aborted(self) -> None:
        self._emit("request_aborted")

    def rejected(self) -> None:
        self._emit("request_rejected")

    def kv_handed_off(self, num_bytes: int, seconds: float) -> None:
        """A prompt's KV sent to a decode instance (the prefill side): its bytes, and the seconds from the fetch's
        request to the last byte sent."""
        self._emit("kv_handed_off", num_bytes, seconds)

    def kv_handoff_failed(self) -> None:
        """A fetch this instance refused (bad request, wrong secret, unknown or expired handle, export failed) or
        could not finish sending."""
        self._emit("kv_handoff_failed")

    def kv_fetched(self, num_bytes: int, seconds: float) -> None:
        """A prompt's KV fetched from a prefill instance (the decode side)."""
        self._emit("kv_fetched", num_bytes, seconds)

    def kv_fetch_failed(self) -> None:
        """A fetch that was refused or failed (its request failed with it)."""
        self._emit("kv_fetch_failed")
