"""RequestFuture: the handle of one LLM request, and the place its front-end work runs.

The engine loop only hands the request's raw EngineOutputs to the future's OutputQueue. Whoever waits on the future
(`result`, `await`, iteration, `output_chunks`) turns them into OutputChunks (detokenizing, matching stop strings,
formatting logprobs) and into RequestOutputs, in its own thread or event loop. A stop string found here becomes a
command to the loop (LLMEngine.finish_sequence). So a future's output is processed while something waits on it; a
stop string in a request nobody waits on is found when someone does (the visible output is the same).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import lru_cache

from petrel.engine.output_processor import RequestOutputProcessor
from petrel.engine.output_queue import OutputQueue
from petrel.outputs import OutputChunk, RequestOutput
from petrel.request_output_builder import RequestOutputBuilder
from petrel.sampling_params import SamplingParams

logger = logging.getLogger("petrel")


def cached_token_decoder(tokenizer, size: int = 1 << 16):
    """tokenizer.decode([id]) with the answers kept: logprob alternatives repeat the same tokens over and over."""
    return lru_cache(maxsize=size)(lambda token_id: tokenizer.decode([token_id]))


class RequestFuture:
    """The handle of one request: ``result(timeout)``, ``await``, ``for partial in f``, ``async for``, ``abort()``."""

    def __init__(
        self,
        request_id,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        streaming: bool,
        engine,
        decode_token=None,
        arrival_time: float = 0.0,
    ):
        self.request_id = request_id
        self.streaming = streaming
        self._engine = engine
        self._params = params
        self._outputs = OutputQueue()  # filled by the engine loop: the request's raw EngineOutputs
        self._processor = RequestOutputProcessor(request_id, engine.tokenizer, prompt_token_ids, params)
        self._builder = RequestOutputBuilder(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            decode_token or cached_token_decoder(engine.tokenizer),
            arrival_time,
        )
        self._lock = threading.Lock()  # one consumer processes at a time, so outputs are processed in order
        self._route = None  # the engine's handle of the request, once queued
        self._reported = False  # its end (finished or aborted) told to engine.events (under _lock)

    # ------------------------------------------------------------------ the engine loop's side
    def _on_output(self, out) -> None:
        """The engine loop's sink: queue the raw output for whoever waits (nothing else runs on the loop)."""
        self._outputs.put(out)

    # ------------------------------------------------------------------ processing (the consumer's thread)
    def _poll(self, waiter=None) -> list[OutputChunk]:
        """Process the outputs queued since the last poll; returns their chunks. Consumers poll under one lock, so one
        that polls after another sees what that one applied: waiting on the queue's version after a poll misses
        nothing."""
        with self._lock:
            outputs = self._outputs.drain(waiter)
            if not outputs:
                return []
            chunks = []
            ended = None
            for out in outputs:
                try:
                    chunk, stop = self._processor.process(out)
                except Exception as exc:  # noqa: BLE001 - this request fails, the consumer and the engine go on
                    logger.exception("processing the output of request %r failed", self.request_id)
                    chunks += self._fail(f"output processing failed: {type(exc).__name__}: {exc}")
                    break
                if stop is not None:
                    self._engine.finish_sequence(self._route, out.index, stop, self._processor.all_finished)
                if chunk is not None:
                    self._builder.apply(chunk)
                    chunks.append(chunk)
            if self._builder.finished and not self._reported:
                self._reported = True
                ended = self._builder.finished_request()
        if ended is not None:  # every front's requests are counted here, once, as their caller sees them end
            self._engine.events.finished(ended)
        return chunks

    def _fail(self, message: str) -> list[OutputChunk]:
        self._engine.abort_request(self.request_id, "cancelled")
        chunks = self._processor.fail(message)
        for chunk in chunks:
            self._builder.apply(chunk)
        return chunks

    def _raise_if_failed(self) -> None:
        if self._builder.error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self._builder.error}")

    # ------------------------------------------------------------------ caller side
    @property
    def finished(self) -> bool:
        self._poll()
        return self._builder.finished

    def done(self) -> bool:
        return self.finished

    def abort(self) -> None:
        """Cancel the request: it finishes with finish_reason 'cancelled' and its KV blocks are freed. Before its end,
        the request counts as aborted (engine.events); after it, this does nothing."""
        with self._lock:
            report = not self._reported and not self._builder.finished
            self._reported = True
        if report:
            self._engine.events.aborted()
        self._engine.abort_request(self.request_id, "cancelled")

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the request to finish (TimeoutError after `timeout` seconds; the request goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self._outputs.version
            self._poll()
            if self._builder.finished:
                break
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            self._outputs.wait(seen, remaining)
        self._raise_if_failed()
        with self._lock:
            return self._builder.result()

    def __await__(self):
        return self._wait_async().__await__()

    async def _wait_async(self) -> RequestOutput:
        waiter = self._outputs.add_waiter()
        try:
            while True:
                self._poll(waiter)
                if self._builder.finished:
                    break
                await self._outputs.wait_async(waiter)
        finally:
            self._outputs.remove_waiter(waiter)
        return self.result(timeout=0)

    def _update(self, marks, shown: int):
        """(the update to yield or None, its marks, the builder version it shows) after a poll."""
        builder = self._builder
        if builder.version == shown or not (self.streaming or builder.finished):
            return None, marks, shown
        self._raise_if_failed()
        with self._lock:
            update, marks = builder.partial(marks)
            return update, marks, builder.version

    def __iter__(self):
        """Each update (streaming: as output arrives, several steps at once when the caller is slower; else only
        the final one): a RequestOutput whose *_diff fields hold what is new since the previous update."""
        marks, shown = None, 0
        while True:
            seen = self._outputs.version
            self._poll()
            update, marks, shown = self._update(marks, shown)
            if update is not None:
                yield update
            if self._builder.finished and shown == self._builder.version:
                return
            self._outputs.wait(seen)

    async def __aiter__(self):
        marks, shown = None, 0
        waiter = self._outputs.add_waiter()
        try:
            while True:
                self._poll(waiter)
                update, marks, shown = self._update(marks, shown)
                if update is not None:
                    yield update
                if self._builder.finished and shown == self._builder.version:
                    return
                await self._outputs.wait_async(waiter)
        finally:
            self._outputs.remove_waiter(waiter)

    def output_chunks(self):
        """The request's per-step OutputChunks (every sequence) as they are processed, until it finished: the stream
        every other view (RequestOutput, executor Responses, server events) is built from. The chunks are not
        kept: an iteration sees those processed while it runs (all of them when it starts first)."""
        while True:
            seen = self._outputs.version
            yield from self._poll()
            if self._builder.finished:
                return
            self._outputs.wait(seen)

    async def output_chunks_async(self, keep_history: bool = True):
        """output_chunks in an event loop. keep_history=False (a consumer that builds its own view, as the server's
        streams do; pass it before anything else consumed the future): the future keeps no text, logprobs or
        logits, so `result()` then carries the token ids, counts, finish reasons and timings only."""
        if not keep_history:
            self._builder.drop_history()
        waiter = self._outputs.add_waiter()
        try:
            while True:
                for chunk in self._poll(waiter):
                    yield chunk
                if self._builder.finished:
                    return
                await self._outputs.wait_async(waiter)
        finally:
            self._outputs.remove_waiter(waiter)
