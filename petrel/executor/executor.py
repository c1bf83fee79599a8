"""The Executor: enqueue token-id requests, await Responses, cancel, read stats (TensorRT-LLM's executor API).

Requests run on the same continuous-batching engine as the LLM API. Responses are built from the engine's
OutputChunks as they arrive; the rules (streaming or not, num_return_sequences, beams) are those of the
executor spec:
- streaming: a Result per step per sequence with its new tokens (all tokens so far with
  return_all_generated_tokens); `is_sequence_final` on a sequence's last Result, `is_final` on the
  request's last one.
- not streaming: one Result per sequence when it finishes, holding all its tokens (the prompt first,
  unless OutputConfig.exclude_input_from_output).
- beam search: one Result (sequence_index 0) holding the best `num_return_sequences` beams (all `beam_width` of
  them by default); streaming, one after each step too, holding the current best running beams whole (their
  tokens may change from one step to the next as beams reorder and fork), the last one the final beams.
  Requests of different beam widths run in the same steps (no reconfiguration between widths).
A malformed request gets a Response with an error (never an exception from the loop); other requests go on.
The engine loop only queues each request's raw outputs; they become chunks and Responses on the thread that awaits
(or counts) responses.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time

from petrel.config import EngineConfig
from petrel.engine.block_manager import held_blocks
from petrel.engine.llm_engine import LLMEngine
from petrel.engine.output_processor import RequestOutputProcessor
from petrel.engine.output_queue import OutputQueue
from petrel.executor.kv_events import KVCacheEventManager, attach_kv_events
from petrel.executor.multimodal import multimodal_inputs
from petrel.executor.packed_lora import adapter_from_packed
from petrel.executor.positions import apply_mrope_config, position_ids_of
from petrel.executor.request_translation import apply_kv_cache_config, configured_outputs, translate_request
from petrel.executor.results import RequestState, responses_for
from petrel.executor.speculation import apply_decoding_config
from petrel.executor.types import (
    ExecutorConfig,
    LogitsPostProcessorConfig,
    Request,
    RequestStage,
    RequestStats,
    RequestStatsPerIteration,
    Response,
)
from petrel.lora import LoRARequest

logger = logging.getLogger("petrel")


class Executor:
    def __init__(
        self, model: str | EngineConfig | None = None, executor_config: ExecutorConfig | None = None, **engine_options
    ):
        self.config = executor_config or ExecutorConfig()
        if isinstance(model, EngineConfig):
            engine_config = model
        else:
            engine_config = EngineConfig.from_kwargs(model=model, **engine_options)
        engine_config = apply_kv_cache_config(self.config.kv_cache_config, engine_config)
        engine_config = apply_decoding_config(self.config.decoding_config, engine_config)
        self._outputs_configured = configured_outputs(self.config)
        lpp = self.config.logits_post_processor_config or LogitsPostProcessorConfig()
        if not isinstance(lpp.replicate, bool):
            raise ValueError(f"logits_post_processor_config.replicate must be a bool, got {lpp.replicate!r}")
        self._post_processors = dict(lpp.processor_map)
        self._loras: dict[int, LoRARequest] = {}  # LoraConfig.task_id -> its adapter, from its first request
        self._packed_loras: dict[int, str] = {}  # task_id -> the digest of the packed tensors it was loaded from
        self._request_stats: collections.deque = collections.deque(maxlen=self.config.request_stats_max_iterations)
        self._engine = LLMEngine(
            engine_config,
            batched_post_processor=lpp.processor_batched,
            stats_history=self.config.iter_stats_max_iterations,
        )
        self._engine.step_observer = self._record_request_stats
        kv = self.config.kv_cache_config
        self._kv_events = None  # KvCacheConfig.event_buffer_max_size > 0: the prefix cache's events
        if kv is not None and kv.event_buffer_max_size:
            size = kv.event_buffer_max_size
            self._kv_events = self._engine.call(lambda core: attach_kv_events(core, size))
        self._ids = itertools.count(1)
        self._outputs = OutputQueue()  # (request state, raw EngineOutput), from the engine loop
        self._lock = threading.Lock()  # the consumer side: processing, _ready and _states
        self._ready: list[Response] = []
        self._states: dict[int, RequestState] = {}
        self._shutdown = False

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    # ------------------------------------------------------------------ requests
    def enqueue_request(self, request: Request) -> int:
        """Queue one request and return its id. A malformed request yields an error Response for that id."""
        if self._shutdown:
            raise RuntimeError("the executor has been shut down")
        request_id = next(self._ids)
        try:
            params, options = translate_request(
                request,
                self.config,
                self._post_processors,
                self._outputs_configured,
                self._engine.model_config.vocab_size,
                self._loras,
                self._packed_loras,
            )
            ids = list(request.input_token_ids)
            engine = self._engine
            multi_modal = multimodal_inputs(request, engine.mm_processor, engine.model_config.hidden_size)
            multi_modal = apply_mrope_config(request, multi_modal, engine.model_config)
            if multi_modal is not None:
                options["multi_modal"] = multi_modal
            positions = position_ids_of(request, engine.model_config)
            if positions is not None:
                options["position_ids"] = positions
            processor = RequestOutputProcessor(request_id, self._engine.tokenizer, ids, params)
            state = RequestState(request_id, request, params, processor, self._engine.config.block_size)
            with self._lock:
                self._states[request_id] = state
            self._add(request_id, ids, params, state, request, options)
        except (ValueError, TypeError) as exc:
            with self._lock:
                self._states.pop(request_id, None)
                self._ready.append(Response(request_id, error_msg=str(exc), client_id=request.client_id))
            self._outputs.wake()
        return request_id

    def _add(self, request_id: int, ids: list[int], params, state: RequestState, request: Request, options: dict):
        lora = options.get("lora_request")
        packed = options.pop("lora_packed", None)
        if packed is not None:
            self._load_packed_lora(lora, *packed)
        try:
            self._engine.add_request(
                request_id,
                ids,
                params,
                lambda out, s=state: self._outputs.put((s, out)),
                cache_salt=request.cache_salt,
                **options,
            )
        except ValueError as exc:
            if lora is not None and "lora" in str(exc):
                raise ValueError(f"lora_config: {exc}") from exc
            raise
        if lora is not None:
            self._loras.setdefault(lora.lora_int_id, lora)  # later requests of this task_id need no path
            if packed is not None:
                self._packed_loras.setdefault(lora.lora_int_id, packed[2])

    def _load_packed_lora(self, lora: LoRARequest, weights, config, digest: str) -> None:
        """A new task_id's packed tensors (TensorRT-LLM's layout, petrel/executor/packed_lora.py) into the engine's
        adapter store, where PEFT directories go too."""
        manager = self._engine.core.lora_manager
        if manager is None:
            raise ValueError("lora_config needs an engine started with enable_lora=True")
        adapter = adapter_from_packed(lora, weights, config, self._engine.model_config, manager.max_rank)
        manager.register(lora, adapter)

    def enqueue_requests(self, requests: list[Request]) -> list[int]:
        return [self.enqueue_request(r) for r in requests]

    def cancel_request(self, request_id: int) -> None:
        """End the request: its last Response has finish reason CANCELLED and its KV blocks are freed."""
        self._engine.abort_request(request_id, "cancelled")

    # ------------------------------------------------------------------ outputs -> responses (the caller's thread)
    def _process_outputs(self) -> None:
        """Turn the raw outputs queued since the last call into Responses (under self._lock, so in order)."""
        for state, out in self._outputs.drain():
            try:
                chunk, _ = state.processor.process(out)
                responses = responses_for(state, chunk) if chunk is not None else []
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                logger.exception("processing the output of request %r failed", state.request_id)
                self._engine.abort_request(state.request_id, "cancelled")
                state.processor.fail(str(exc))
                for seq in state.seqs:
                    seq.finished = True
                responses = [
                    Response(
                        state.request_id,
                        error_msg=f"output processing failed: {exc}",
                        client_id=state.request.client_id,
                    )
                ]
            self._ready.extend(responses)
            if all(s.finished for s in state.seqs):
                self._states.pop(state.request_id, None)

    # ------------------------------------------------------------------ responses (caller side)
    def await_responses(self, request_id: int | list[int] | None = None, timeout: float | None = None):
        """Responses ready now, waiting up to `timeout` seconds (None: until there is one) for the first.
        No id: responses of any request (an empty list at once when none is in flight). An id: that
        request's (ValueError for an id that has nothing left to give). A list of ids: a list of lists."""
        if isinstance(request_id, (list, tuple)):
            wanted = set(request_id)
            self._check_known(wanted)
            got = self._take(lambda r: r.request_id in wanted, timeout, lambda: bool(wanted & set(self._states)))
            return [[r for r in got if r.request_id == i] for i in request_id]
        if request_id is None:
            return self._take(lambda r: True, timeout, lambda: bool(self._states))
        self._check_known({request_id})
        return self._take(lambda r: r.request_id == request_id, timeout, lambda: request_id in self._states)

    def _check_known(self, ids: set) -> None:
        """An id with nothing in flight and nothing ready would be waited on forever: refuse it."""
        with self._lock:
            unknown = ids - set(self._states) - {r.request_id for r in self._ready}
        if unknown:
            raise ValueError(
                f"request ids {sorted(unknown)} are not in flight and have no responses ready "
                f"(never enqueued, or finished and already awaited)"
            )

    def _take(self, match, timeout: float | None, pending) -> list[Response]:
        """Wait for responses that `match`; `pending()` says whether any could still come (else return now)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            seen = self._outputs.version
            with self._lock:
                self._process_outputs()
                taken = [r for r in self._ready if match(r)]
                if taken:
                    self._ready = [r for r in self._ready if not match(r)]
                    return taken
                if self._shutdown or not pending():
                    return []
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return []
            self._outputs.wait(seen, remaining)

    def get_num_responses_ready(self, request_id: int | None = None) -> int:
        with self._lock:
            self._process_outputs()
            return sum(1 for r in self._ready if request_id is None or r.request_id == request_id)

    def can_enqueue_requests(self) -> bool:
        return not self._shutdown

    def get_kv_cache_event_manager(self) -> KVCacheEventManager | None:
        """The KV cache's events (stored / removed blocks; petrel/executor/kv_events.py), or None unless
        KvCacheConfig.event_buffer_max_size > 0."""
        return self._kv_events

    # ------------------------------------------------------------------ stats
    def get_latest_iteration_stats(self) -> list:
        """IterationStats of the steps run since the last call (oldest first)."""
        history = self._engine.stats_history
        stats = []
        while history:
            stats.append(history.popleft())
        return stats

    def get_latest_request_stats(self) -> list[RequestStatsPerIteration]:
        """The request stats of each iteration run since the last call (oldest first; at most
        ExecutorConfig.request_stats_max_iterations of them)."""
        stats = []
        while self._request_stats:
            stats.append(self._request_stats.popleft())
        return stats

    def _record_request_stats(self, core) -> None:
        """After each engine step (on the loop thread): the requests in flight then."""
        if self._request_stats.maxlen:
            self._request_stats.append(RequestStatsPerIteration(core.iteration, _request_stats(core)))

    def shutdown(self) -> None:
        if not self._shutdown:
            self._engine.shutdown()
            with self._lock:
                self._shutdown = True
            self._outputs.wake()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _request_stats(core) -> list[RequestStats]:
    bs = core.block_manager.block_size
    stats = []
    for req in core.requests.values():
        live = [s for s in req.seqs if not s.is_finished]
        if not live:
            continue
        prompt_len = len(req.prompt_token_ids)
        prefilled = max(min(s.num_computed_tokens, prompt_len) for s in live)
        running = any(s.status.value == "running" for s in live)
        stage = (
            RequestStage.QUEUED
            if not running
            else (RequestStage.CONTEXT_IN_PROGRESS if prefilled < prompt_len else RequestStage.GENERATION_IN_PROGRESS)
        )
        stats.append(
            RequestStats(
                id=req.request_id,
                stage=stage,
                context_prefill_position=prefilled,
                num_generated_tokens=sum(s.num_output_tokens for s in req.seqs),
                num_sequences=len(live),
                allocated_blocks=sum(len(held_blocks(t)) for s in live for t in s.block_tables),
                reused_blocks=max(s.num_cached_tokens for s in live) // bs,
                scheduled=running,
            )
        )
    return stats
