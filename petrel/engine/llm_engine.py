"""The engine loop, apart from its callers: commands in through a queue, each step's raw EngineOutputs out to
per-request sinks. The loop does engine work only: detokenizing, stop strings, logprob text and the API's output
objects run on the consumer's side (petrel/request_future.py, the executor, the server), which sends a stop string it
found back as a command (finish_sequence)."""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from petrel.config import EngineConfig
from petrel.distributed.group import threads_per_rank
from petrel.distributed.runner import start_workers
from petrel.engine.attention_windows import apply_attention_windows
from petrel.engine.engine_core import EngineCore
from petrel.engine.engine_output import EngineOutput
from petrel.engine.grammar import GrammarCompiler
from petrel.engine.model_runner import ExecutorDied
from petrel.engine.sequence import EngineRequest
from petrel.model.loader import load_model, load_model_config, resolve_model
from petrel.model.parallel import SINGLE, check_tensor_parallel
from petrel.model.tokenizer import load_tokenizer
from petrel.multimodal.prompts import load_processor
from petrel.request_events import RequestEvents

logger = logging.getLogger("petrel")

OutputSink = Callable[[EngineOutput], None]  # called on the loop thread: must only hand the output over
STEP_STALL_LIMIT = 60.0  # seconds one engine step may run before check_health stops taking it as a sign of life


class RequestRoute:
    """Where a request's outputs go, and which of its sequences the engine has not ended yet. add_request returns
    it; finish_sequence takes it back, so a command can never reach a later request that reuses the id."""

    __slots__ = ("request_id", "sink", "unfinished", "num_sequences")

    def __init__(self, request_id, sink: OutputSink, params):
        self.request_id = request_id
        self.sink = sink
        self.unfinished = set(range(params.n))  # loop thread only
        self.num_sequences = max(params.n, params.num_beams)  # what a server's queue limit counts


class LLMEngine:
    def __init__(self, config: EngineConfig, batched_post_processor=None, stats_history: int = 1000):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.source = resolve_model(config.model, config.mmproj)
        self.tokenizer = load_tokenizer(self.source, config.tokenizer)
        # a vision-language model's processor (prompt + images -> ids and encoder inputs), None for text only
        self.mm_processor = load_processor(
            self.source.path if self.source.kind == "hf" else None, self.tokenizer, self.source.mmproj
        )
        workers = self._start_workers(config)
        try:
            self.core = self._build_core(config, batched_post_processor, workers)
        except BaseException:
            if workers is not None:
                workers.shutdown()
            raise
        self.stats_history: deque = deque(maxlen=stats_history)  # IterationStats of recent steps
        self.step_observer: Callable | None = None  # fn(core), called on the loop thread after each step
        self.events = RequestEvents()  # requests' ends on their callers' side, for /metrics (petrel/request_events.py)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[object, RequestRoute] = {}  # request id -> its route, from "add" to its end (loop thread)
        self._in_flight: dict[object, RequestRoute] = {}  # request id added and not finished (any thread, under
        # the lock)
        self._in_flight_lock = threading.Lock()
        self._grammar_compiler: GrammarCompiler | None = None
        self._deadlines: dict[object, float] = {}
        self._stopped = threading.Event()
        self._closed = False  # the loop takes no more commands (set under _in_flight_lock)
        self._dead: str | None = None  # "the engine loop has stopped: <cause>" once the loop thread died
        self.step_started: float | None = None  # time.monotonic() when the step now running began
        self._thread = threading.Thread(target=self._run, name="petrel-engine", daemon=True)
        self._thread.start()

    def _start_workers(self, config: EngineConfig):
        """With tensor_parallel_size > 1: ranks 1..N-1 started and the group joined as rank 0 (else None)."""
        size = config.tensor_parallel_size
        if size == 1:
            return None
        check_tensor_parallel(load_model_config(self.source), size, config.enable_expert_parallel)  # before any process
        torch.set_num_threads(threads_per_rank(config))
        return start_workers(config, self.source)

    def _build_core(self, config: EngineConfig, batched_post_processor, workers) -> EngineCore:
        model, model_config = load_model(
            self.source,
            config.torch_dtype,
            config.device,
            config.quantization,
            tp=workers.tp if workers is not None else SINGLE,
            float32_matmul_precision=config.float32_matmul_precision,
        )
        apply_attention_windows(model, model_config, config)
        eos = set(model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        draft = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and model_config.multimodal_config is not None:
            raise ValueError(
                "speculative_config: a draft model cannot run with a vision-language model (the draft would not see "
                "the images); use method 'ngram' or 'self'"
            )
        if spec is not None and spec.method == "draft_model":  # runs whole in the engine process, even with TP
            draft_source = resolve_model(spec.draft_model)
            # the draft follows the quantization where it can ('gguf' needs a GGUF draft; another loads dense)
            draft_quantization = (
                None if config.quantization == "gguf" and draft_source.kind != "gguf" else config.quantization
            )
            draft = load_model(
                draft_source,
                config.torch_dtype,
                config.device,
                draft_quantization,
                float32_matmul_precision=config.float32_matmul_precision,
            )
            if draft[1].vocab_size != model_config.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({draft[1].vocab_size} tokens) differs from the "
                    f"target's ({model_config.vocab_size}): speculative decoding needs the same one"
                )
        return EngineCore(config, model, model_config, batched_post_processor, draft, workers)

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the whole KV cache holds (below max_model_len when sliding-window blocks are given back), held
        whole in every KV group (a disaggregated prompt is)."""
        bm = self.core.block_manager
        return bm.num_blocks // bm.num_groups * bm.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token of context takes over every layer (EngineCore.kv_bytes_per_token)."""
        return self.core.kv_bytes_per_token

    # ------------------------------------------------------------------ caller side (any thread)
    def add_request(
        self,
        request_id,
        prompt_token_ids: list[int],
        params,
        sink: OutputSink,
        timeout: float | None = None,
        cache_salt: str | None = None,
        **request_options,
    ) -> RequestRoute:
        """Validate (ValueError to the caller), then queue the request for the engine loop; returns its route (for
        finish_sequence).

        sink: called on the loop thread with each of the request's EngineOutputs, every sequence ending with one
        that has a finish_reason; it should only hand the output over (e.g. OutputQueue.put).
        request_options: EngineRequest fields the executor sets (client_id, logits_post_processor,
        use_batched_post_processor, priority)."""
        self._raise_if_closed()
        if params.bad_words:  # a copy: the caller's params stay as given (the tokenizer's ids need no revalidation)
            params = copy.copy(params)
            params.bad_words_token_ids = params.bad_words_token_ids + self._bad_word_ids(params.bad_words)
        if request_options.get("use_batched_post_processor") and self.core.sampler.batched_post_processor is None:
            raise ValueError("logits_post_processor_name asks for the batched post-processor, but none is configured")
        self.core.validate(prompt_token_ids, params, self.eos_token_ids)
        lora_request = request_options.get("lora_request")
        if lora_request is not None:
            from petrel.lora import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a petrel.lora.LoRARequest, got {type(lora_request).__name__}")
            if self.core.lora_manager is None:
                raise ValueError("lora_request needs an engine started with enable_lora=True")
            self.core.lora_manager.register(lora_request)  # reads the adapter now: ValueError for a bad one
        if params.guided_decoding is not None:
            request_options["compiled_grammar"] = self.grammar_compiler.compile(params.guided_decoding)
        if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > 512):
            raise ValueError("cache_salt must be a string of at most 512 characters")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        request = EngineRequest(
            request_id, list(prompt_token_ids), params, self.eos_token_ids, cache_salt, **request_options
        )
        if timeout is not None:
            request.deadline = request.arrival_time + timeout
        route = RequestRoute(request_id, sink, params)
        with self._in_flight_lock:  # queued under the lock: a loop that has closed never misses it
            if self._closed:
                self._raise_if_closed(closed=True)
            if request_id in self._in_flight:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._in_flight[request_id] = route
            self._commands.put(("add", request, route))
        return route

    def _raise_if_closed(self, closed: bool = False) -> None:
        """RuntimeError if the engine takes no new work: its loop died (naming why) or it was shut down."""
        if self._dead is not None:
            raise RuntimeError(self._dead)
        if closed or self._stopped.is_set():
            raise RuntimeError("the engine has been shut down")

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use (reading the vocabulary takes a fraction of a second)."""
        with self._in_flight_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, list(self.eos_token_ids)
                )
            return self._grammar_compiler

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as it would be tokenized alone and after a space (both spellings are banned), once each,
        in order. Duplicates are found in a set: a membership test on the list made 16,000 words take seconds."""
        seen: set[tuple[int, ...]] = set()
        ids = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                key = tuple(tokens)
                if tokens and key not in seen:
                    seen.add(key)
                    ids.append(tokens)
        return ids

    def abort_request(self, request_id, message: str = "cancelled") -> None:
        self._commands.put(("abort", request_id, message))

    def finish_sequence(self, route: RequestRoute, index: int, stop_reason, request_finished: bool = False) -> None:
        """The consumer found a stop string in sequence `index`: the loop ends it before its next step (whatever the
        engine produced for it meanwhile, the consumer drops). request_finished: every sequence of the request has
        ended for the consumer; the request stops counting as in flight now (its id may be used again at once: the
        loop ends it before it takes any later command)."""
        with self._in_flight_lock:
            if request_finished and self._in_flight.get(route.request_id) is route:
                del self._in_flight[route.request_id]
            if not self._closed:
                self._commands.put(("finish", route, index, stop_reason))

    def abort_all(self, message: str) -> None:
        """End every request in flight with an abort carrying `message` (e.g. a server shutting down)."""
        self._commands.put(("abort_all", message))

    @property
    def num_unfinished_requests(self) -> int:
        """Requests added and not finished yet (queued, waiting or running)."""
        with self._in_flight_lock:
            return len(self._in_flight)

    @property
    def num_unfinished_sequences(self) -> int:
        """Sequences the unfinished requests run (n, or the beam width, each): what a server's queue limit counts."""
        with self._in_flight_lock:
            return sum(route.num_sequences for route in self._in_flight.values())

    def call(self, fn: Callable, timeout: float | None = 30.0):
        """Run fn(core) inside the engine loop and return its result (a health check, stats, tests)."""
        done = threading.Event()
        box = {}

        def job(core):
            try:
                box["value"] = fn(core)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            done.set()

        with self._in_flight_lock:
            if self._closed:  # nothing would ever answer
                self._raise_if_closed(closed=True)
            self._commands.put(("call", job))
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not answer in time")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def check_health(self, timeout: float = 0.2) -> None:
        """Raise unless the engine loop is alive and either in a step begun less than STEP_STALL_LIMIT ago (no
        waiting behind a long step) or answering a round trip within `timeout` (TimeoutError: a stuck loop)."""
        if self._dead is not None:
            raise RuntimeError(self._dead)
        if self._stopped.is_set() or not self._thread.is_alive():
            raise RuntimeError("the engine loop is not running")
        self.core.runner.check_health()  # a tensor-parallel worker that died, even while the engine is idle
        started = self.step_started
        if started is not None and time.monotonic() - started < STEP_STALL_LIMIT:
            return
        self.call(lambda core: None, timeout=timeout)
        if self._dead is not None:  # answered by a dying loop's last drain
            raise RuntimeError(self._dead)

    def shutdown(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._commands.put(("stop",))
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=30)
            self.core.runner.shutdown()
            self.core.close()
            if self._grammar_compiler is not None:
                self._grammar_compiler.close()  # its compile worker processes

    # ------------------------------------------------------------------ engine side
    def _run(self) -> None:
        """The loop thread: however it ends (shutdown, or an exception of any kind escaping the loop, which would
        otherwise end the thread silently and leave every request hanging), every request in flight or queued gets
        a final abort chunk, and no new work is taken."""
        message = "the engine has been shut down"
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a daemon thread: nothing above it to re-raise to
            logger.critical("the engine loop died", exc_info=True)
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            message = self._dead = f"the engine loop has stopped: {cause}"
        finally:
            with self._in_flight_lock:
                self._closed = True
            self._fail_all(message)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            busy = self.core.has_work
            wait = 0.0 if busy else (0.05 if self._deadlines else None)
            try:
                cmd = self._commands.get(timeout=wait) if wait != 0.0 else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._handle(cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._stopped.is_set():
                break
            self._expire_deadlines()
            if self.core.has_work:
                self.step_started = time.monotonic()
                try:
                    outputs = self.core.step()
                except ExecutorDied:
                    raise  # no step can run any more: the loop stops, failing every request with the cause
                except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the loop
                    logger.exception("engine step failed")
                    self._fail_all(f"engine error: {exc}")
                    continue
                finally:
                    self.step_started = None
                stats = self.core.last_stats
                if stats is not None and (not self.stats_history or self.stats_history[-1] is not stats):
                    self.stats_history.append(stats)
                if self.step_observer is not None:
                    try:
                        self.step_observer(self.core)
                    except Exception:  # noqa: BLE001 - an observer never stops the loop
                        logger.exception("step observer failed")
                self._dispatch(outputs)

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request, route = cmd
            self._routes[request.request_id] = route
            if request.deadline is not None:
                self._deadlines[request.request_id] = request.deadline
            self.core.add_request(request)
        elif kind == "finish":
            self._finish_sequence(*cmd[1:])
        elif kind == "abort":
            _, request_id, message = cmd
            self._dispatch(self.core.abort_request(request_id, message))
        elif kind == "abort_all":
            for request_id in list(self._routes):
                self._dispatch(self.core.abort_request(request_id, cmd[1]))
        elif kind == "call":
            cmd[1](self.core)

    def _finish_sequence(self, route: RequestRoute, index: int, stop_reason) -> None:
        """End a sequence the consumer found a stop string in, unless the engine ended it first; its sink still gets
        the sequence's last output (a stop with nothing new), so every sink sees every sequence end."""
        if self._routes.get(route.request_id) is not route or index not in route.unfinished:
            return
        self.core.finish_sequence(route.request_id, index, stop_reason)
        self._deliver(
            route,
            EngineOutput(
                route.request_id, index, [], finish_reason="stop", stop_reason=stop_reason, timestamp=time.monotonic()
            ),
        )

    def _expire_deadlines(self) -> None:
        if not self._deadlines:
            return
        now = time.monotonic()
        for request_id in [r for r, t in self._deadlines.items() if t <= now]:
            self._dispatch(self.core.abort_request(request_id, "timeout"))

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        """Hand each output to its request's sink: all the loop does with a step's outputs."""
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is not None and out.index in route.unfinished:
                self._deliver(route, out)

    def _deliver(self, route: RequestRoute, out: EngineOutput) -> None:
        if out.finish_reason is not None:
            route.unfinished.discard(out.index)
            if not route.unfinished:  # the request's last output: forget it
                del self._routes[route.request_id]
                self._deadlines.pop(route.request_id, None)
                with self._in_flight_lock:
                    if self._in_flight.get(route.request_id) is route:
                        del self._in_flight[route.request_id]
        try:
            route.sink(out)
        except Exception:  # noqa: BLE001 - a caller's sink must not stop the engine
            logger.exception("output sink for request %r failed", route.request_id)

    def _fail_all(self, message: str) -> None:
        while True:  # requests still queued get their answer too
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._routes[cmd[1].request_id] = cmd[2]
            elif cmd[0] == "call":
                cmd[1](self.core)
        for request_id in list(self._routes):
            try:
                self._dispatch(self.core.abort_request(request_id, message))
            except BaseException:  # noqa: BLE001 - a broken core or dispatch: answered below instead
                logger.exception("aborting request %r failed", request_id)
        for route in list(self._routes.values()):  # queued but never added to the core, or not aborted
            for index in sorted(route.unfinished):
                try:
                    route.sink(EngineOutput(route.request_id, index, [], finish_reason="abort", abort_message=message))
                except BaseException:  # noqa: BLE001 - one caller's sink must not keep the others waiting
                    logger.exception("output sink for request %r failed", route.request_id)
        self._routes.clear()
        with self._in_flight_lock:
            self._in_flight.clear()
