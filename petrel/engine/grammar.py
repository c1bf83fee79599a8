"""Guided decoding with xgrammar: compile a request's constraint (bounded in size and in time, shared by concurrent
requests, cached by kind and spec within a byte budget), give each sequence a matcher, and mask a step's guided
rows with one bitmask.

Where compiles run: in child processes (petrel/engine/grammar_worker.py), one per compile thread of the
GrammarCompiler's own (2 by default), never in the engine loop, a server's event loop or asyncio's default
executor. xgrammar's compile is C++ that cannot be interrupted, and a constraint of a few bytes can run for
minutes (a JSON schema pattern `a{N}`: 1.5 s at N = 5000, 6.4 s at 10000, growing as N squared), so:
  - input limits (GuidedDecodingLimits) refuse an oversized constraint before any compile;
  - a compile still running at `compile_timeout` has its process killed: the request gets a ValueError naming its
    constraint, and the CPU and memory it held are back at once (a thread could only be abandoned, still running);
  - at most `workers` compiles run and `max_queued` more wait; past that, or after waiting `compile_timeout` for a
    free worker, a compile is refused with GrammarCompilerBusy (a server's 429) rather than piling up.
The price of the processes (measured on a shared 2-core CPU): the first compile waits for a worker to start
(importing xgrammar, and with it torch: 3-5 s), each worker holds ~200 MB of its own, and a compiled grammar
crosses the pipe serialized (CompiledGrammar.serialize_json): a typical schema takes ~20 ms instead of ~6 ms, a
12.5 MB grammar (4096 choices) ~2.5 s instead of 0.4 s.

A bad schema, regex or grammar is a ValueError for that request alone.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future

import torch

from petrel.engine import grammar_worker
from petrel.guided_decoding import GuidedDecodingLimits, GuidedDecodingParams
from petrel.heap import release_free_memory

logger = logging.getLogger("petrel")

DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds; every constraint within the default limits compiles in ~3 s or less
DEFAULT_CACHE_BYTES = 64 * 1024**2  # compiled grammars kept for reuse (a 1000-string choice list is ~3.6 MB)
# a grammar larger than this is not kept once its requests end: a 58-byte repeat-count regex compiled to ~130 MB,
# and caching it held that much for good
DEFAULT_MAX_CACHED_GRAMMAR_BYTES = 8 * 1024**2
RELEASE_AFTER_CHARS = 8 * 1024**2  # a serialized grammar this large: give its memory back after reading it
WORKER_START_TIMEOUT = 120.0  # seconds for a compile worker to import xgrammar and read the vocabulary


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ValueError(
            "guided decoding needs xgrammar: pip install xgrammar "
            "(on CPU-only machines `pip install --no-deps xgrammar apache-tvm-ffi` is enough)"
        ) from exc
    return xgrammar


class GrammarCompilerBusy(RuntimeError):
    """No compile worker is free and the queue is full, or a compile waited its whole timeout for one."""


class GrammarCompiler:
    """Compiles GuidedDecodingParams into xgrammar CompiledGrammars (see the module docstring for where and how).

    limits: the largest constraint taken (GuidedDecodingLimits' defaults). compile_timeout: seconds one compile may
    run before its worker is killed. cache_bytes: the compiled grammars kept, by their memory_size_bytes (a grammar
    a request still holds is found again however much the cache has evicted). workers: compiles at once, each in
    its own process with threads_per_worker xgrammar threads. max_queued: distinct compiles that may wait.
    max_cached_grammar_bytes: a larger grammar serves the requests that hold it, and is not cached."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        limits: GuidedDecodingLimits | None = None,
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        workers: int = 2,
        max_queued: int = 16,
        threads_per_worker: int = 2,
        max_cached_grammar_bytes: int = DEFAULT_MAX_CACHED_GRAMMAR_BYTES,
    ):
        _xgrammar()
        if compile_timeout <= 0 or cache_bytes < 0 or workers < 1 or max_queued < 0 or threads_per_worker < 1:
            raise ValueError(
                "GrammarCompiler needs compile_timeout > 0, cache_bytes >= 0, workers >= 1, "
                "max_queued >= 0 and threads_per_worker >= 1"
            )
        self.vocab_size = vocab_size
        self.limits = limits or GuidedDecodingLimits()
        self.compile_timeout = compile_timeout
        self.cache_bytes = cache_bytes
        self.max_cached_grammar_bytes = max_cached_grammar_bytes
        self.max_queued = max_queued
        self._vocabulary = _Vocabulary(tokenizer, vocab_size, stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()  # least recently used first
        self._cached_bytes = 0
        self._live = weakref.WeakValueDictionary()  # every compiled grammar still referenced anywhere, by key
        self._in_flight: dict[tuple[str, str], Future] = {}  # compiling or waiting to: concurrent requests share it
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.num_compiled = 0  # compiles that ran to a grammar (a repeated constraint is served from the cache)
        self._workers = [_CompileWorker(self._vocabulary, threads_per_worker) for _ in range(workers)]
        for i, worker in enumerate(self._workers):
            threading.Thread(target=self._drive, args=(worker,), name=f"petrel-grammar-{i}", daemon=True).start()
        weakref.finalize(self, _stop_all, self._workers)

    # ------------------------------------------------------------------ callers (any thread)
    def compile(self, params: GuidedDecodingParams):
        """The compiled grammar, waiting for it in this thread (at most about twice compile_timeout, and a worker's
        start)."""
        return self.submit(params).result()

    def submit(self, params: GuidedDecodingParams) -> Future:
        """A future of the compiled grammar, this caller's own (cancelling it leaves the compile to the others
        waiting for the same constraint). Raises at once: ValueError for a constraint over the limits or not
        well formed, GrammarCompilerBusy when the queue is full."""
        self.limits.check(params)
        key = (params.kind, params.spec)
        with self._lock:
            shared = self._shared_future(key, params)
        mine: Future = Future()
        shared.add_done_callback(lambda done: _forward(done, mine))
        return mine

    def _shared_future(self, key, params: GuidedDecodingParams) -> Future:
        """(Under the lock.) The cached grammar as a finished future, the compile already under way, or a new one."""
        if self._closed:
            raise RuntimeError("the grammar compiler has been closed")
        compiled = self._cached(key)
        if compiled is not None:
            done: Future = Future()
            done.set_result(compiled)
            return done
        if key in self._in_flight:
            return self._in_flight[key]
        if len(self._in_flight) >= len(self._workers) + self.max_queued:
            raise GrammarCompilerBusy(
                f"the guided decoding compiler is busy ({len(self._workers)} compiles running, "
                f"{len(self._in_flight) - len(self._workers)} waiting); retry later"
            )
        request = _worker_request(params)
        future: Future = Future()
        self._in_flight[key] = future
        expiry = threading.Timer(self.compile_timeout, self._expire, args=(key, future))
        expiry.daemon = True
        expiry.start()
        self._jobs.put((key, params.kind, request, future, expiry))
        return future

    def _expire(self, key, future: Future) -> None:
        """A compile still waiting for a worker after compile_timeout is refused (its job is then skipped)."""
        with self._lock:
            if future.done() or future.running():
                return
            self._in_flight.pop(key, None)
            future.set_exception(
                GrammarCompilerBusy(
                    f"the guided decoding compiler is busy: this constraint waited {self.compile_timeout:g} s for a "
                    "free compile worker; retry later"
                )
            )

    def _cached(self, key):
        """(Under the lock.) The compiled grammar for key if one is cached or still held by a request, else None."""
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            return entry[0]
        compiled = self._live.get(key)
        if compiled is not None:
            self._store(key, compiled)
        return compiled

    def _store(self, key, compiled) -> None:
        """(Under the lock.) Cache it, evicting the least recently used until the cache is within cache_bytes."""
        self._live[key] = compiled
        size = compiled.memory_size_bytes
        if size > min(self.cache_bytes, self.max_cached_grammar_bytes):
            return
        self._cache[key] = (compiled, size)
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self._cached_bytes -= evicted

    @property
    def cached_bytes(self) -> int:
        """memory_size_bytes of the grammars in the cache, together (at most cache_bytes)."""
        with self._lock:
            return self._cached_bytes

    def is_cached(self, params: GuidedDecodingParams) -> bool:
        with self._lock:
            return (params.kind, params.spec) in self._cache

    def close(self) -> None:
        """Stop the compile workers; compiles waiting fail with RuntimeError, later calls too."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for future in self._in_flight.values():
                future.cancel()  # a waiting compile's future is still pending: it ends here
        for _ in self._workers:
            self._jobs.put(None)
        _stop_all(self._workers)

    # ------------------------------------------------------------------ compile threads
    def _drive(self, worker: _CompileWorker) -> None:
        """One compile thread: starts its worker process (so that the first compile finds it importing already),
        then takes the next job and compiles it there."""
        try:
            worker.start()
        except Exception:  # noqa: BLE001 - reported by the first compile, which tries again
            logger.warning("a grammar compile worker could not be started", exc_info=True)
        while (job := self._jobs.get()) is not None:
            key, kind, request, future, expiry = job
            expiry.cancel()
            with self._lock:  # refused by _expire, or cancelled by close(): skipped
                if future.done() or not future.set_running_or_notify_cancel():
                    continue
            try:
                compiled = self._run(worker, kind, request)
            except BaseException as exc:  # noqa: BLE001 - handed to the callers
                with self._lock:
                    self._in_flight.pop(key, None)
                future.set_exception(exc)
            else:
                with self._lock:
                    self._store(key, compiled)
                    self._in_flight.pop(key, None)
                    self.num_compiled += 1
                future.set_result(compiled)
        worker.stop()

    def _run(self, worker: _CompileWorker, kind: str, request: bytes):
        timeout = self.compile_timeout
        try:
            text = worker.compile(request, timeout)
        except TimeoutError:
            raise ValueError(
                f"guided_decoding.{kind}: the constraint took longer than {timeout:g} s to compile "
                "(a smaller or simpler one compiles faster)"
            ) from None
        except _CompileError as exc:
            message = _LOG_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"guided_decoding.{kind} could not be compiled: {message}") from None
        except _WorkerDied as exc:
            raise ValueError(
                f"guided_decoding.{kind}: the grammar compiler stopped while compiling it ({exc})"
            ) from None
        compiled = _xgrammar().CompiledGrammar.deserialize_json(text, self._vocabulary.info())
        if len(text) > RELEASE_AFTER_CHARS:
            del text
            release_free_memory()  # the serialized text and its parse are gone: hand their memory back
        return compiled

    @staticmethod
    def matcher(compiled):
        return _xgrammar().GrammarMatcher(compiled)


def _worker_request(params: GuidedDecodingParams) -> bytes:
    """What a compile worker is sent for this constraint (grammar_worker.compile_request reads it)."""
    kind = params.kind
    if kind in ("json", "json_object"):  # json_object: any JSON object (the builtin JSON grammar allows any value)
        text = params.schema_text() if kind == "json" else '{"type": "object"}'
        request = {
            "method": "json_schema",
            "text": text,
            "any_whitespace": params.any_whitespace,
            "before": params.json_prefix,
            "after": params.json_suffix,
        }
    elif kind == "choice":
        alternatives = " | ".join(json.dumps(x, ensure_ascii=False) for x in params.choice)
        request = {"method": "grammar", "text": "root ::= " + alternatives}
    elif kind in ("regex", "grammar"):
        request = {"method": kind, "text": getattr(params, kind)}
    else:
        request = {"method": "structural_tag", "text": params.spec}
    return json.dumps(request).encode()


def _forward(source: Future, target: Future) -> None:
    """Give target source's outcome, unless target was cancelled."""
    if not target.set_running_or_notify_cancel():
        return
    if source.cancelled():
        target.set_exception(RuntimeError("the grammar compiler has been closed"))
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


class _Vocabulary:
    """The tokenizer as xgrammar sees it, built on first use (reading a vocabulary takes a fraction of a second):
    the TokenizerInfo deserializing a compiled grammar needs, and its JSON that each worker reads."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._args = (tokenizer, vocab_size, list(stop_token_ids))
        self._info = self._json = None
        self._lock = threading.Lock()

    def info(self):
        with self._lock:
            if self._info is None:
                tokenizer, vocab_size, stop_token_ids = self._args
                self._info = _xgrammar().TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
                )
                self._json = self._info.serialize_json().encode()
            return self._info

    def json(self) -> bytes:
        self.info()
        return self._json


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[22:43:19] /project/cpp/x.cc:94: "


class _CompileError(Exception):
    """xgrammar refused the constraint (its message)."""


class _WorkerDied(Exception):
    """The worker process ended while compiling (crashed, or was killed from outside)."""


class _CompileWorker:
    """One child process running grammar_worker.py, used by one compile thread (which starts it at once). Killed
    when a compile runs past its timeout, and then started again at once, so that the next compile finds it ready
    sooner; started again too by the next compile if it died or could not start."""

    def __init__(self, vocabulary: _Vocabulary, threads: int):
        self._vocabulary = vocabulary
        self._threads = threads
        self._process: subprocess.Popen | None = None
        self._ready = False
        self._stopped = False

    def compile(self, request: bytes, timeout: float) -> str:
        """The serialized compiled grammar. TimeoutError past timeout seconds (the process is replaced),
        _CompileError for a constraint xgrammar refuses, _WorkerDied if the process ended."""
        self._wait_ready()
        process = self._process
        try:
            grammar_worker.write_message(process.stdin.fileno(), request)
            reply = _read_message(process.stdout.fileno(), time.monotonic() + timeout)
        except TimeoutError:
            self.restart()
            raise
        except (EOFError, OSError):
            code = self.stop()
            self._raise_if_stopped()
            raise _WorkerDied(f"exit code {code}") from None
        if reply[:1] == b"E":
            raise _CompileError(reply[1:].decode(errors="replace"))
        return reply[1:].decode()

    def _wait_ready(self) -> None:
        self._raise_if_stopped()
        if self._process is None:
            self.start()
        if self._ready:
            return
        try:
            reply = _read_message(self._process.stdout.fileno(), time.monotonic() + WORKER_START_TIMEOUT)
        except (TimeoutError, EOFError, OSError) as exc:
            code = self.stop()
            self._raise_if_stopped()
            raise RuntimeError(
                f"the grammar compile worker did not start ({type(exc).__name__}, exit code {code}); "
                "its error, if any, is on stderr"
            ) from None
        if reply != b"R":
            self.stop()
            raise RuntimeError(f"the grammar compile worker answered {reply[:40]!r} instead of being ready")
        self._ready = True

    def start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-P", grammar_worker.__file__, str(self._threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )  # a terminal's Ctrl-C is the parent's to handle
        self._ready = False
        try:
            grammar_worker.write_message(self._process.stdin.fileno(), self._vocabulary.json())
        except OSError:
            pass  # it died at once: _wait_ready reports it

    def restart(self) -> None:
        self.stop()
        if not self._stopped:
            self.start()

    def stop(self) -> int | None:
        """(Its own compile thread only.) Kill the process, if any, and close its pipes; its exit code."""
        process, self._process, self._ready = self._process, None, False
        if process is None:
            return None
        process.kill()
        code = process.wait()
        process.stdin.close()
        process.stdout.close()
        return code

    def close(self) -> None:
        """(Any thread.) No more compiles; the process is killed, and its compile thread, if in a compile, sees
        it end (the pipes stay open until that thread stops it: their file descriptors are its to close)."""
        self._stopped = True
        process = self._process
        if process is not None:
            process.kill()

    def _raise_if_stopped(self) -> None:
        if self._stopped:
            raise RuntimeError("the grammar compiler has been closed")


def _stop_all(workers: list[_CompileWorker]) -> None:
    for worker in workers:
        worker.close()


def _read_message(fd: int, deadline: float) -> bytes:
    """One framed message from fd; TimeoutError if it has not all come by deadline (time.monotonic()), EOFError at
    end of input."""
    header = _read_exact(fd, grammar_worker.HEADER.size, deadline)
    return _read_exact(fd, grammar_worker.HEADER.unpack(header)[0], deadline)


def _read_exact(fd: int, size: int, deadline: float) -> bytes:
    buffer = bytearray()
    while len(buffer) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError
        chunk = os.read(fd, min(size - len(buffer), 1 << 20))
        if not chunk:
            raise EOFError
        buffer += chunk
    return bytes(buffer)


def apply_grammar_masks(logits: torch.Tensor, matchers: dict[int, object]) -> None:
    """Mask every row that has a matcher to the tokens its grammar allows next (one bitmask, one apply)."""
    xgr = _xgrammar()
    rows = sorted(matchers)
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
