"""RedisBlockStore: the KV block store that instances share, on a Redis or Valkey server.

Blobs are opaque here (the block codec makes and checks them); a key is a block's chain hash, stored under
`<namespace>:<hex>`. put() only queues: one background thread writes, within a bound on queued puts and bytes, so
the engine never waits on the network (a full queue drops the put and counts it). get() is synchronous with a short
socket timeout. When the server goes away nothing raises: get returns None, put drops, contains says False, with one
warning per outage (at most one per warn_interval_s); after a backoff (doubling up to max_backoff_s) the next call
probes the server, and the store resumes when it answers. `pip install petrel[kv-store]` brings the client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "petrel:kv"
STAT_NAMES = ("hits", "misses", "puts", "bytes_in", "bytes_out", "dropped", "errors")


class RedisBlockStore:
    """A BlockStore (petrel/kv_tiers/base.py) on a Redis / Valkey server at `url` (redis://, rediss://, unix://).

    ttl_s: each block expires this long after its last put (None: kept until the server's eviction policy drops
    it; give the server a maxmemory and an LRU policy). max_value_bytes: a larger blob is dropped, not written.
    max_pending_puts / max_pending_bytes: the write queue's bound. get_timeout_s: a get's (and a connect's) socket
    timeout; put_timeout_s: the writer's. stats(): bytes_in are bytes written into the store, bytes_out bytes read
    from it."""

    name = "store"

    def __init__(
        self,
        url: str,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        ttl_s: float | None = None,
        max_value_bytes: int = 64 * 1024**2,
        max_pending_puts: int = 4096,
        max_pending_bytes: int = 256 * 1024**2,
        get_timeout_s: float = 0.5,
        put_timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        warn_interval_s: float = 60.0,
    ):
        for field, value in (
            ("max_value_bytes", max_value_bytes),
            ("max_pending_puts", max_pending_puts),
            ("max_pending_bytes", max_pending_bytes),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field, value in (
            ("get_timeout_s", get_timeout_s),
            ("put_timeout_s", put_timeout_s),
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be > 0 seconds, got {value!r}")
        if ttl_s is not None and (not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be > 0 seconds or None, got {ttl_s!r}")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")
        self.url, self.namespace = url, namespace
        self.max_value_bytes, self.max_pending_puts, self.max_pending_bytes = (
            max_value_bytes,
            max_pending_puts,
            max_pending_bytes,
        )
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._errors, self._connection_errors = _redis_errors()
        self._reader = _client(url, get_timeout_s)
        self._writer = _client(url, put_timeout_s)
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._stats_lock = threading.Lock()
        # reachability: None while up; when down, the next probe waits until _retry_at
        self._health_lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._initial_backoff, self._max_backoff, self._backoff = backoff_s, max_backoff_s, backoff_s
        self._warn_interval, self._last_warning = warn_interval_s, float("-inf")
        # the write queue
        self._queue: deque[tuple[bytes, bytes]] = deque()
        self._queued_bytes = 0
        self._writing = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._write_loop, name="petrel-kv-store-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ BlockStore
    def get(self, key: bytes) -> bytes | None:
        """The blob stored under key, or None (absent, or the server unreachable: never raises)."""
        if not self._may_call():
            self._count(misses=1)
            return None
        try:
            blob = self._reader.get(self.redis_key(key))
        except self._errors as exc:
            self._failed(exc, "get")
            self._count(misses=1)
            return None
        self._reachable()
        if blob is None:
            self._count(misses=1)
            return None
        self._count(hits=1, bytes_out=len(blob))
        return bytes(blob)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """get() for several keys in one round trip (MGET), in order."""
        if not keys:
            return []
        if not self._may_call():
            self._count(misses=len(keys))
            return [None] * len(keys)
        try:
            blobs = self._reader.mget([self.redis_key(k) for k in keys])
        except self._errors as exc:
            self._failed(exc, "get")
            self._count(misses=len(keys))
            return [None] * len(keys)
        self._reachable()
        found = [b for b in blobs if b is not None]
        self._count(hits=len(found), misses=len(blobs) - len(found), bytes_out=sum(len(b) for b in found))
        return [None if b is None else bytes(b) for b in blobs]

    def put(self, key: bytes, blob: bytes) -> None:
        """Queue the blob for the writer thread; dropped (and counted) when it is too large, the queue is full, the
        server is down (until the next probe) or the store is closed. Never blocks on the network, never raises."""
        size = len(blob)
        if size > self.max_value_bytes or self._waiting_for_probe():
            self._count(dropped=1)
            return
        blob = blob if isinstance(blob, bytes) else bytes(blob)  # the caller may reuse its buffer
        with self._cond:
            full = len(self._queue) >= self.max_pending_puts or self._queued_bytes + size > self.max_pending_bytes
            if self._closed or full:
                dropped = True
            else:
                dropped = False
                self._queue.append((bytes(key), blob))
                self._queued_bytes += size
                self._cond.notify()
        if dropped:
            self._count(dropped=1)

    def contains(self, key: bytes) -> bool:
        """Whether the store holds key now (False when the server is unreachable)."""
        if not self._may_call():
            return False
        try:
            found = bool(self._reader.exists(self.redis_key(key)))
        except self._errors as exc:
            self._failed(exc, "contains")
            return False
        self._reachable()
        return found

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    # ------------------------------------------------------------------ the rest
    def redis_key(self, key: bytes) -> str:
        """The server-side key of a chain hash: `<namespace>:<hex>`."""
        return f"{self.namespace}:{bytes(key).hex()}"

    @property
    def available(self) -> bool:
        """False while the server is known to be down (between a failure and a successful probe)."""
        with self._health_lock:
            return self._down_since is None

    @property
    def pending_puts(self) -> int:
        with self._cond:
            return len(self._queue) + int(self._writing)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued put has been written (or dropped); False if timeout came first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._writing, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the writer (puts still queued are dropped and counted) and close the connections."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._count(dropped=dropped)
        self._thread.join(timeout)
        for client in (self._reader, self._writer):
            try:
                client.close()
            except Exception:  # closing is best effort
                pass

    def __enter__(self) -> RedisBlockStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisBlockStore({_redacted(self.url)!r}, namespace={self.namespace!r})"

    # ------------------------------------------------------------------ the writer thread
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                key, blob = self._queue.popleft()
                self._writing = True
            try:
                self._write(key, blob)
            except Exception:  # never let the writer die: a put is best effort
                logger.exception("kv store: unexpected error writing a block")
                self._count(errors=1, dropped=1)
            finally:
                with self._cond:
                    self._queued_bytes -= len(blob)
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, key: bytes, blob: bytes) -> None:
        if not self._may_call():
            self._count(dropped=1)
            return
        try:
            self._writer.set(self.redis_key(key), blob, px=self._ttl_ms)
        except self._errors as exc:
            self._failed(exc, "put")
            self._count(dropped=1)
            return
        self._reachable()
        self._count(puts=1, bytes_in=len(blob))

    # ------------------------------------------------------------------ reachability
    def _waiting_for_probe(self) -> bool:
        with self._health_lock:
            return self._down_since is not None and time.monotonic() < self._retry_at

    def _may_call(self) -> bool:
        """Up, or down with its backoff over: then this call is the probe (the next one waits another backoff)."""
        with self._health_lock:
            if self._down_since is None:
                return True
            now = time.monotonic()
            if now < self._retry_at:
                return False
            self._retry_at = now + self._backoff
            return True

    def _failed(self, exc: Exception, what: str) -> None:
        self._count(errors=1)
        now = time.monotonic()
        with self._health_lock:
            if isinstance(exc, self._connection_errors):
                if self._down_since is None:
                    self._down_since, self._backoff = now, self._initial_backoff
                else:
                    self._backoff = min(self._backoff * 2, self._max_backoff)
                self._retry_at = now + self._backoff
                state = f"unreachable; retrying in {self._backoff:g} s, recomputing meanwhile"
            else:
                state = "the command failed"
            warn = now - self._last_warning >= self._warn_interval
            if warn:
                self._last_warning = now
        if warn:
            name = type(exc).__name__
            logger.warning("kv store %s: %s failed (%s: %s); %s", _redacted(self.url), what, name, exc, state)

    def _reachable(self) -> None:
        with self._health_lock:
            if self._down_since is None:
                return
            down_for = time.monotonic() - self._down_since
            self._down_since, self._backoff = None, self._initial_backoff
        logger.info("kv store %s: reachable again after %.1f s", _redacted(self.url), down_for)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._stats[name] += delta


def store_from_config(config, **options) -> RedisBlockStore | None:
    """The shared store an EngineConfig names (kv_store_url), or None; options go to RedisBlockStore."""
    url = getattr(config, "kv_store_url", None)
    return RedisBlockStore(url, **options) if url else None


def _redis_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(every error a call may raise, those that mean the server is unreachable)."""
    import redis

    unreachable = (redis.ConnectionError, redis.TimeoutError, OSError)
    return (redis.RedisError, *unreachable), unreachable


def _client(url: str, timeout: float):
    """A client for url whose calls fail at once (no retries) after `timeout` seconds; the store's own backoff
    decides when to try again."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ImportError(
            "kv_store_url needs the redis client: pip install 'petrel[kv-store]' (or pip install redis)"
        ) from None
    if not isinstance(url, str) or not url:
        raise ValueError(f"kv_store_url must be a redis://, rediss:// or unix:// URL, got {url!r}")
    try:
        return redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
    except ValueError as exc:
        raise ValueError(f"kv_store_url {_redacted(url)!r}: {exc}") from None


def _redacted(url: str) -> str:
    """The URL without its password (redis://user:secret@host -> redis://user:***@host)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    auth, _, host = rest.rpartition("@")
    user = auth.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in auth else url
