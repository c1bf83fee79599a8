"""Reading KV blocks from the slow tiers (disk, the shared store) off the engine thread.

One background thread works through a bounded queue of fetches, each one waiting request's blocks, and leaves the
blobs it reads in host memory (TierChain's staging area). The engine never waits on a fetch: it polls it (done, or
past its deadline) and meanwhile runs the batch without that request; once the fetch is settled, the request's
prefix lookup finds its blocks in memory. A fetch whose request went away is cancelled: nothing more is staged
for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("petrel")
MAX_QUEUED_FETCHES = 256  # requests whose fetch waits for the worker, at most (the next ones are not fetched)


@dataclass(eq=False)
class Fetch:
    """One request's blocks to read: their keys in chain order, and what came of it."""

    keys: list[bytes]
    deadline: float  # time.monotonic() after which the request is admitted with whatever host memory holds
    hinted: bool = False  # the keys a dkv_cache_hint named
    cancelled: bool = False  # its request went away: nothing more is staged for it
    blocks: int = 0  # blobs read into host memory for it
    bytes: int = 0
    staged: list[bytes] = field(default_factory=list)  # the keys staged for it (unstaged again if cancelled)
    done: threading.Event = field(default_factory=threading.Event)

    def settled(self, now: float) -> bool:
        return self.done.is_set() or now >= self.deadline


class FetchWorker:
    def __init__(self, read: Callable[[Fetch], None], timeout_s: float, max_queued: int = MAX_QUEUED_FETCHES):
        """read(fetch): reads the fetch's blocks into host memory (on the worker's thread; may raise: the fetch is
        then done with what it read). timeout_s: each fetch's deadline, from its submission."""
        self.read = read
        self.timeout_s = timeout_s
        self._queue: queue.Queue[Fetch | None] = queue.Queue(max_queued)
        self.submitted = 0
        self.refused = 0  # fetches not queued: the queue was full
        self._thread = threading.Thread(target=self._run, name="petrel-kv-fetch", daemon=True)
        self._thread.start()

    def submit(self, keys: list[bytes], hinted: bool = False) -> Fetch | None:
        """Queue a fetch of these keys; None when the queue is full (the request goes on without one)."""
        fetch = Fetch(list(keys), time.monotonic() + self.timeout_s, hinted)
        try:
            self._queue.put_nowait(fetch)
        except queue.Full:
            self.refused += 1
            return None
        self.submitted += 1
        return fetch

    def _run(self) -> None:
        while (fetch := self._queue.get()) is not None:
            try:
                if not fetch.cancelled:
                    self.read(fetch)
            except Exception as exc:  # noqa: BLE001 - a failed fetch means recomputation, never a dead worker
                logger.warning("KV tier fetch of %d blocks failed: %s", len(fetch.keys), exc)
            finally:
                fetch.done.set()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the queued fetches and stop the thread."""
        while True:
            try:
                fetch = self._queue.get_nowait()
            except queue.Empty:
                break
            if fetch is not None:
                fetch.cancelled = True
                fetch.done.set()
        self._queue.put(None)
        self._thread.join(timeout)
