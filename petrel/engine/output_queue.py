"""The hand-over from the engine loop to a consumer: the loop only appends a step's raw outputs and wakes whoever
waits; the consumer (a caller's thread, an event loop) drains them and does the front-end work there.

`put` is the whole of the loop's per-output cost: an append under a lock, a notify, and at most one wake-up per
async waiter until that waiter has drained (so a slow consumer is not woken once per output). Waiting is by
version: read `version`, look at the state, then `wait(version)` returns as soon as anything was put or woken
since, so no wake-up falls between the look and the wait.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque


class AsyncWaiter:
    """One coroutine waiting on a queue from its event loop."""

    __slots__ = ("event", "loop", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.event = asyncio.Event()
        self.pending = False  # a set() is scheduled and not yet seen (no second one is sent meanwhile)


class OutputQueue:
    def __init__(self):
        self._items: deque = deque()
        self._cond = threading.Condition(threading.Lock())
        self._version = 0
        self._waiters: list[AsyncWaiter] = []
        self.signal: threading.Event | None = None  # also set on each put (one wait over several queues)
        self.signal_final_only = False  # ... or only on a put that ends a sequence (finish_reason set)

    @property
    def version(self) -> int:
        """Changes with every put and wake."""
        return self._version

    # ------------------------------------------------------------------ the engine loop's side
    def put(self, item) -> None:
        with self._cond:
            self._items.append(item)
            self._version += 1
            self._cond.notify_all()
            waiters = self._take_waiters()
        self._wake_async(waiters)
        if self.signal is not None and (not self.signal_final_only or item.finish_reason is not None):
            self.signal.set()

    # ------------------------------------------------------------------ the consumer's side
    def drain(self, waiter: AsyncWaiter | None = None) -> list:
        """Everything put so far, oldest first (and `waiter` may be woken again by the next put)."""
        with self._cond:
            if waiter is not None:
                waiter.pending = False
            items = list(self._items)
            self._items.clear()
        return items

    def wake(self) -> None:
        """Wake every waiter without an item (a consumer's state changed otherwise: an error answer, a shutdown)."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()
            waiters = self._take_waiters()
        self._wake_async(waiters)
        if self.signal is not None:
            self.signal.set()

    def wait(self, since: int, timeout: float | None = None) -> bool:
        """Block until the version moved past `since` (False: `timeout` seconds passed first)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._version != since, timeout)

    def add_waiter(self) -> AsyncWaiter:
        waiter = AsyncWaiter(asyncio.get_running_loop())
        with self._cond:
            self._waiters.append(waiter)
        return waiter

    def remove_waiter(self, waiter: AsyncWaiter) -> None:
        with self._cond:
            self._waiters.remove(waiter)

    @staticmethod
    async def wait_async(waiter: AsyncWaiter) -> None:
        """Until the next put or wake after `waiter`'s last drain."""
        await waiter.event.wait()
        waiter.event.clear()

    def _take_waiters(self) -> list[AsyncWaiter]:
        woken = []
        for w in self._waiters:
            if not w.pending:
                w.pending = True
                woken.append(w)
        return woken

    @staticmethod
    def _wake_async(waiters: list[AsyncWaiter]) -> None:
        for w in waiters:
            try:
                w.loop.call_soon_threadsafe(w.event.set)
            except RuntimeError:
                pass  # that event loop is closed
