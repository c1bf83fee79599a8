"""The gRPC worker's pool for the requests whose preparation grows with their size (bad words to tokenize, a large
message to convert and check): off the gRPC event loop, so HealthCheck, GetModelInfo and the other requests go on
meanwhile, and apart from what every request needs, so small requests never queue behind a large one.

Daemon threads: a server told to stop does not wait for a preparation to end (the request goes with the server).
A ThreadPoolExecutor's threads are joined at interpreter exit, which would hold SIGTERM for as long as the
preparation under way takes."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future

# one: large requests are prepared one at a time, so a stream of them takes at most one core from serving
PREPARE_THREADS = 1


class PreparePool:
    def __init__(self, threads: int = PREPARE_THREADS, name: str = "petrel-grpc-prepare"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    async def run(self, fn, on_orphan=None):
        """fn() on the pool, awaited. When the awaiting task is cancelled (the client went away) after fn started,
        fn runs to its end and on_orphan(its result) cleans up after it; a job not started yet does not run."""
        future: Future = Future()
        self._jobs.put((future, fn))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if on_orphan is not None:
                future.add_done_callback(lambda f: f.cancelled() or f.exception() or on_orphan(f.result()))
            raise

    def close(self) -> None:
        """The threads end after the jobs queued so far (nothing waits for them)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                future.set_exception(exc)
            else:
                future.set_result(result)


async def run_inline(fn, on_orphan=None):
    """PreparePool.run's counterpart for a request prepared on the event loop itself (a few ms at most)."""
    return fn()
