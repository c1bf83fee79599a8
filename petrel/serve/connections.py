"""The connection guard: a deadline for each request's headers, a cap on open connections, and resource-exhaustion
errors logged at most once per interval.

uvicorn closes an idle keep-alive connection, but not one whose request headers arrive a byte at a time, and it
accepts connections until the process runs out of file descriptors (a slowloris attack: thousands of half-sent
headers hold every descriptor, /health stops answering, and asyncio logs "Too many open files" on every accept).
`ConnectionGuard.protocol_class()` subclasses uvicorn's HTTP protocol so that

- a connection whose request headers have not all arrived `header_timeout` seconds after it opened (or after its
  previous response) is closed, with a 408 when part of a request had arrived;
- at most `max_connections` are open: at the cap a new connection first evicts the connection that has waited
  longest (at least `evict_after` seconds) for its first request's headers, else the keep-alive connection idle
  longest; with none to evict it gets a 503 written straight to the socket, its request unparsed (the socket
  lingers up to REFUSAL_LINGER seconds, half-closed, so that the client reads the 503 instead of a reset; past
  max_lingering such sockets, it is closed at once). A connection serving a request is never evicted, so under
  a flood of slow connections a client that sends its request promptly (a /health probe) still gets in.
"""

from __future__ import annotations

import errno
import json
import logging
import resource
import threading
import time
from collections import Counter, OrderedDict

import uvicorn

logger = logging.getLogger("petrel.serve.connections")

DEFAULT_HEADER_TIMEOUT = 10.0
EVICT_AFTER = 0.1  # seconds a connection may wait for its headers before a newcomer at the cap may evict it
MAX_DEFAULT_CONNECTIONS = 4096
REFUSAL_LINGER = 1.0  # seconds a refused connection stays half-closed, its input discarded
REPORT_INTERVAL = 10.0  # seconds between the guard's (and the exhaustion filter's) log lines
_EXHAUSTION_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def raise_open_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit (Linux often starts at 1024 of a much
    larger hard limit); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def open_file_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(file_limit: int | None = None) -> int:
    """Half the open-file limit (the rest for the model, logs, KV transfer and sockets being closed), at most
    MAX_DEFAULT_CONNECTIONS, at least 32."""
    file_limit = open_file_limit() if file_limit is None else file_limit
    return max(32, min(MAX_DEFAULT_CONNECTIONS, file_limit // 2))


def default_backlog(file_limit: int | None = None) -> int:
    """uvicorn's listen backlog (2048), at most a quarter of the open-file limit, at least 64."""
    file_limit = open_file_limit() if file_limit is None else file_limit
    return max(64, min(2048, file_limit // 4))


def _raw_error_response(status: int, reason: str, message: str, type_: str, code: str, extra: str = "") -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-style error body that closes the connection, as bytes to write
    straight to a socket (no request was parsed, so there is no ASGI cycle to answer through)."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """One server's limits and bookkeeping, shared by the connections its protocol_class() makes: the connections
    admitted, and those waiting for request headers in the order they began to wait (oldest first), the ones yet
    to send a first request apart from idle keep-alive ones."""

    def __init__(
        self,
        header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        max_connections: int | None = None,
        evict_after: float = EVICT_AFTER,
    ):
        if header_timeout <= 0:
            raise ValueError(f"header_timeout must be positive, got {header_timeout}")
        max_connections = default_max_connections() if max_connections is None else max_connections
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.header_timeout, self.max_connections, self.evict_after = header_timeout, max_connections, evict_after
        self.admitted: set = set()
        self.lingering = 0  # refused connections not closed yet
        self.max_lingering = max(16, max_connections // 16)
        self.waiting_first: OrderedDict = OrderedDict()  # connection -> monotonic time it connected
        self.waiting_again: OrderedDict = OrderedDict()  # connection -> monotonic time of its last response
        self.totals: Counter = Counter()  # refused / evicted / header_timeout, since start
        self._window: Counter = Counter()
        self._last_report = float("-inf")
        self.refusal = _raw_error_response(
            503,
            "Service Unavailable",
            f"the server has too many open connections ({max_connections}); retry later",
            "service_unavailable",
            "too_many_connections",
            extra="retry-after: 1\r\n",
        )
        self.timeout_response = _raw_error_response(
            408,
            "Request Timeout",
            f"the request headers did not arrive within {header_timeout:g} s",
            "invalid_request_error",
            "request_timeout",
        )

    def protocol_class(self, base: type | None = None) -> type:
        """uvicorn's HTTP protocol (`base`, default the one uvicorn picks) guarded by this guard: pass it as
        uvicorn.Config(http=...)."""
        if base is None:
            from uvicorn.protocols.http.auto import AutoHTTPProtocol

            base = AutoHTTPProtocol
        return type(f"Guarded{base.__name__}", (_GuardedConnection, base), {"guard": self})

    def admit(self, conn) -> bool:
        """Whether a new connection may open: under the cap, or at it once the longest waiter is evicted."""
        if len(self.admitted) >= self.max_connections and not self._evict_longest_waiting():
            self.note("refused")
            return False
        self.admitted.add(conn)
        return True

    def _evict_longest_waiting(self) -> bool:
        now = time.monotonic()
        for waiting in (self.waiting_first, self.waiting_again):
            if waiting:
                conn, since = next(iter(waiting.items()))
                if now - since >= self.evict_after:
                    conn.evict()
                    self.note("evicted")
                    return True
        return False

    def start_waiting(self, conn, first: bool) -> None:
        """`conn` now waits for request headers: its first request's (`first`) or, after a response, the next."""
        self.stop_waiting(conn)
        (self.waiting_first if first else self.waiting_again)[conn] = time.monotonic()

    def stop_waiting(self, conn) -> None:
        self.waiting_first.pop(conn, None)
        self.waiting_again.pop(conn, None)

    def forget(self, conn) -> None:
        self.admitted.discard(conn)
        self.stop_waiting(conn)

    def note(self, event: str) -> None:
        """Counts a refusal, eviction or header timeout; logs the counts at most once per REPORT_INTERVAL (a
        warning when the cap was reached, else info: an idle preconnected socket also times out)."""
        self.totals[event] += 1
        self._window[event] += 1
        now = time.monotonic()
        if now - self._last_report >= REPORT_INTERVAL:
            since = "" if self._last_report == float("-inf") else f" in the last {now - self._last_report:.0f} s"
            counts = ", ".join(f"{n} {event}" for event, n in sorted(self._window.items()))
            at_cap = self._window["refused"] or self._window["evicted"]
            logger.log(
                logging.WARNING if at_cap else logging.INFO,
                "connections: %s%s (%d open, cap %d)",
                counts,
                since,
                len(self.admitted),
                self.max_connections,
            )
            self._window.clear()
            self._last_report = now


class _GuardedConnection:
    """Mixed in before uvicorn's HTTP protocol (h11 or httptools: both set `self.cycle` when a request's headers
    are complete and call on_response_complete() after each response)."""

    guard: ConnectionGuard
    _refused = False
    _timer = None  # the request-header deadline, or a refused connection's end of lingering
    _waiting_cycle = None  # the cycle current when the wait for request headers began: a new one ends it
    _partial = False  # bytes of the awaited request have arrived
    _lingering = False  # refused, half-closed, counted in guard.lingering

    def connection_made(self, transport) -> None:
        if not self.guard.admit(self):
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._await_request(first=True)

    def _refuse(self, transport) -> None:
        """The 503, then EOF; the client's bytes are discarded until it closes or REFUSAL_LINGER passes (closing
        a socket with unread input would reset it, and the client might never see the 503)."""
        self._refused, self.transport = True, transport
        transport.write(self.guard.refusal)
        if self.guard.lingering >= self.guard.max_lingering or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._lingering = True
        self.guard.lingering += 1
        self._timer = self.loop.call_later(REFUSAL_LINGER, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._timer is not None:
            self._partial = True
        super().data_received(data)
        if self._timer is not None and self.cycle is not self._waiting_cycle:
            self._request_started()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request (a new cycle)
        if not self.transport.is_closing() and getattr(self.cycle, "response_complete", True):
            self._await_request(first=False)

    def eof_received(self):
        if self._refused:
            return None  # the client read the 503 and closed: close our side too
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        if self._refused:
            self._cancel_timer()
            if self._lingering:
                self._lingering = False
                self.guard.lingering -= 1
            return
        self._cancel_timer()
        self.guard.forget(self)
        super().connection_lost(exc)

    def evict(self) -> None:
        """Closed to make room for a new connection (this one has waited longest for request headers)."""
        self._cancel_timer()
        self.guard.forget(self)
        self.transport.close()

    def _await_request(self, first: bool) -> None:
        self._cancel_timer()
        self._waiting_cycle, self._partial = self.cycle, False
        self._timer = self.loop.call_later(self.guard.header_timeout, self._header_timeout_expired)
        self.guard.start_waiting(self, first)

    def _request_started(self) -> None:
        self._cancel_timer()
        self.guard.stop_waiting(self)

    def _header_timeout_expired(self) -> None:
        self._timer = None
        self.guard.stop_waiting(self)
        if self.transport.is_closing():
            return
        self.guard.note("header_timeout")
        if self._partial or self._pipelined_bytes():
            self.transport.write(self.guard.timeout_response)
        self.transport.close()

    def _pipelined_bytes(self) -> bool:
        """Part of the next request came with the previous one (h11 holds it unparsed; httptools keeps none)."""
        trailing = getattr(getattr(self, "conn", None), "trailing_data", None)
        return bool(trailing and trailing[0])

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


# ------------------------------------------------------------------------------------------- log rate limit


def is_resource_exhaustion(record: logging.LogRecord) -> bool:
    """A record about running out of file descriptors or socket memory: asyncio's failed accept(), or a request
    handler failing with EMFILE (uvicorn's "Exception in ASGI application"), directly or as the cause of another
    error."""
    message = str(record.msg)
    if "out of system resource" in message or "Too many open files" in message:
        return True
    exc, seen = record.exc_info[1] if record.exc_info else None, 0
    while exc is not None and seen < 8:
        if (isinstance(exc, OSError) and exc.errno in _EXHAUSTION_ERRNOS) or "Too many open files" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class RateLimitedLogFilter(logging.Filter):
    """Lets through one record that `matches` per `interval` seconds and drops the others; the next one let
    through says how many were dropped. Records that do not match pass untouched."""

    def __init__(self, matches=is_resource_exhaustion, interval: float = REPORT_INTERVAL, clock=time.monotonic):
        super().__init__()
        self.matches, self.interval, self.clock = matches, interval, clock
        self.suppressed = 0
        self._last = float("-inf")
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.matches(record):
            return True
        with self._lock:
            now = self.clock()
            if now - self._last < self.interval:
                self.suppressed += 1
                return False
            if self.suppressed:
                record.msg = (
                    f"{record.getMessage()}\n({self.suppressed} more like this in the last "
                    f"{now - self._last:.0f} s were not logged)"
                )
                record.args = None
            self._last, self.suppressed = now, 0
            return True


EXHAUSTION_LOGGERS = ("asyncio", "uvicorn.error")


def install_exhaustion_log_filter(interval: float = REPORT_INTERVAL) -> None:
    """Rate-limits resource-exhaustion records on the loggers that report failed accepts and handler errors
    (once per logger: installing again changes nothing)."""
    for name in EXHAUSTION_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, RateLimitedLogFilter) for f in log.filters):
            log.addFilter(RateLimitedLogFilter(interval=interval))


def guarded_config(app, guard: ConnectionGuard, **options) -> uvicorn.Config:
    """uvicorn.Config for `app` whose connections go through `guard` (header deadline, connection cap), with
    resource-exhaustion log records (failed accepts, EMFILE) rate-limited. The listen backlog (also how many
    connections asyncio accepts at once, before the guard sees them) is a quarter of the open-file limit at
    most, so that the cap (half of it by default) plus one burst of accepts fits under it."""
    options.setdefault("backlog", default_backlog())
    config = uvicorn.Config(app, http=guard.protocol_class(), **options)
    install_exhaustion_log_filter()
    return config
