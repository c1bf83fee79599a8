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

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from petrel.config import EngineConfig
from petrel.engine.block_manager import held_blocks
from petrel.engine.llm_engine import LLMEngine
from petrel.engine.output_processor import RequestOutputProcessor
from petrel.engine.output_queue import OutputQueue
from petrel.executor.types import (
    AdditionalOutput,
    ExecutorConfig,
    FinishReason,
    LogitsPostProcessorConfig,
    Request,
    RequestStage,
    RequestStats,
    Response,
    Result,
)
from petrel.outputs import OutputChunk
from petrel.sampling_params import SamplingParams

logger = logging.getLogger("petrel")


@dataclass
class _Sequence:
    """What a non-streaming request accumulates per sequence until it finishes."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    generation_logits: list = field(default_factory=list)
    generation_outputs: dict = field(default_factory=dict)
    decoding_iter: int = 0
    finished: bool = False
    finish_reason: FinishReason = FinishReason.NOT_FINISHED


class _RequestState:
    def __init__(self, request_id: int, request: Request, params: SamplingParams, processor: RequestOutputProcessor):
        self.request_id = request_id
        self.request = request
        self.params = params
        self.processor = processor  # its raw outputs -> chunks (token ids only: no detokenizing, no stop strings)
        self.seqs = [_Sequence() for _ in range(params.n)]
        self.context_logits = None
        self.context_outputs: dict = {}
        self.context_sent = False


class Executor:
    def __init__(
        self, model: str | EngineConfig | None = None, executor_config: ExecutorConfig | None = None, **engine_options
    ):
        self.config = executor_config or ExecutorConfig()
        if isinstance(model, EngineConfig):
            engine_config = model
        else:
            engine_config = EngineConfig.from_kwargs(model=model, **engine_options)
        lpp = self.config.logits_post_processor_config or LogitsPostProcessorConfig()
        self._post_processors = dict(lpp.processor_map)
        self._engine = LLMEngine(
            engine_config,
            batched_post_processor=lpp.processor_batched,
            stats_history=self.config.iter_stats_max_iterations,
        )
        self._ids = itertools.count(1)
        self._outputs = OutputQueue()  # (request state, raw EngineOutput), from the engine loop
        self._lock = threading.Lock()  # the consumer side: processing, _ready and _states
        self._ready: list[Response] = []
        self._states: dict[int, _RequestState] = {}
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
            params, options = self._translate(request)
            ids = list(request.input_token_ids)
            state = _RequestState(
                request_id, request, params, RequestOutputProcessor(request_id, self._engine.tokenizer, ids, params)
            )
            with self._lock:
                self._states[request_id] = state
            self._engine.add_request(
                request_id,
                ids,
                params,
                lambda out, s=state: self._outputs.put((s, out)),
                cache_salt=request.cache_salt,
                **options,
            )
        except (ValueError, TypeError) as exc:
            with self._lock:
                self._states.pop(request_id, None)
                self._ready.append(Response(request_id, error_msg=str(exc), client_id=request.client_id))
            self._outputs.wake()
        return request_id

    def enqueue_requests(self, requests: list[Request]) -> list[int]:
        return [self.enqueue_request(r) for r in requests]

    def cancel_request(self, request_id: int) -> None:
        """End the request: its last Response has finish reason CANCELLED and its KV blocks are freed."""
        self._engine.abort_request(request_id, "cancelled")

    def _translate(self, request: Request) -> tuple[SamplingParams, dict]:
        if not isinstance(request, Request):
            raise TypeError(f"enqueue_request takes an executor Request, got {type(request).__name__}")
        if not request.input_token_ids:
            raise ValueError("input_token_ids is empty: at least one token is needed")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {request.max_tokens!r}")
        sc, oc = request.sampling_config, request.output_config
        guided = request.guided_decoding_params.to_params() if request.guided_decoding_params is not None else None
        width = sc.beam_width
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"sampling_config.beam_width must be an integer >= 1, got {width!r}")
        if width > self.config.max_beam_width:
            raise ValueError(
                f"sampling_config.beam_width {width} exceeds ExecutorConfig.max_beam_width "
                f"({self.config.max_beam_width})"
            )
        n = request.num_return_sequences or sc.num_return_sequences or width  # beams: all `width` by default
        if n > (width if width > 1 else self.config.max_num_return_sequences):
            raise ValueError(
                f"num_return_sequences {n} exceeds "
                + (
                    f"the beam width ({width})"
                    if width > 1
                    else f"ExecutorConfig.max_num_return_sequences ({self.config.max_num_return_sequences})"
                )
            )
        sampling = any(v is not None for v in (sc.temperature, sc.top_k, sc.top_p, sc.min_p))
        early = sc.early_stopping
        if isinstance(early, int) and not isinstance(early, bool):
            early = bool(early)
        stop_words = [list(w) for w in request.stop_words or []]
        names = [o.name for o in (oc.additional_model_outputs or [])]
        params = SamplingParams(
            n=n,
            max_tokens=request.max_tokens,
            min_tokens=sc.min_tokens or 0,
            temperature=(1.0 if sc.temperature is None else sc.temperature) if sampling and width == 1 else 0.0,
            top_k=sc.top_k or 0,
            top_p=1.0 if sc.top_p in (None, 0.0) else sc.top_p,
            min_p=sc.min_p or 0.0,
            seed=sc.seed,
            repetition_penalty=sc.repetition_penalty or 1.0,
            presence_penalty=sc.presence_penalty or 0.0,
            frequency_penalty=sc.frequency_penalty or 0.0,
            stop_token_sequences=stop_words,
            bad_words_token_ids=[list(w) for w in request.bad_words or []],
            use_beam_search=width > 1,
            beam_width=width if width > 1 else None,
            length_penalty=1.0 if sc.length_penalty is None else sc.length_penalty,
            early_stopping=False if early is None else early,
            logprobs=0 if oc.return_log_probs else None,
            return_context_logits=oc.return_context_logits,
            return_generation_logits=oc.return_generation_logits,
            additional_model_outputs=names,
            detokenize=False,
            guided_decoding=guided,
            ignore_eos=request.end_id is not None,
            stop_token_ids=[request.end_id] if request.end_id is not None else None,
        )
        options = {"client_id": request.client_id, "priority": request.priority}
        if request.streaming and width > 1:
            options["stream_beams"] = True
        name = request.logits_post_processor_name
        if name is not None:
            if name == Request.BATCHED_POST_PROCESSOR_NAME:
                options["use_batched_post_processor"] = True
            elif name in self._post_processors:
                options["logits_post_processor"] = self._post_processors[name]
            else:
                raise ValueError(
                    f"logits_post_processor_name {name!r} is not configured; known: "
                    f"{sorted(self._post_processors) + [Request.BATCHED_POST_PROCESSOR_NAME]}"
                )
        if not 0.0 <= request.priority <= 1.0:
            raise ValueError(f"priority must be in [0, 1], got {request.priority!r}")
        return params, options

    # ------------------------------------------------------------------ outputs -> responses (the caller's thread)
    def _process_outputs(self) -> None:
        """Turn the raw outputs queued since the last call into Responses (under self._lock, so in order)."""
        for state, out in self._outputs.drain():
            try:
                chunk, _ = state.processor.process(out)
                responses = self._responses(state, chunk) if chunk is not None else []
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

    def _responses(self, state: _RequestState, chunk: OutputChunk) -> list[Response]:
        req, params = state.request, state.params
        if chunk.context_logits is not None:
            state.context_logits = chunk.context_logits
        if chunk.additional_context_outputs:
            state.context_outputs = chunk.additional_context_outputs
        indices = range(params.n) if chunk.index < 0 else [chunk.index]
        error = chunk.error
        for i in indices:
            seq = state.seqs[i]
            if seq.finished:
                continue
            if chunk.replaces:  # a beam's whole output so far
                state.seqs[i] = seq = _Sequence()
            seq.token_ids.extend(chunk.output_ids)
            seq.log_probs.extend(chunk.output_token_logprobs)
            if chunk.generation_logits is not None:
                seq.generation_logits.append(chunk.generation_logits)
            for name, value in (chunk.additional_generation_outputs or {}).items():
                seq.generation_outputs.setdefault(name, []).append(value)
            if chunk.output_ids:
                seq.decoding_iter += 1 if not params.use_beam_search else len(chunk.output_ids)
            seq.finished = chunk.finish_reason is not None
            seq.finish_reason = self._finish_reason(chunk)
        if error is not None:
            return (
                [Response(state.request_id, error_msg=error, client_id=req.client_id)]
                if all(s.finished for s in state.seqs)
                else []
            )
        if params.use_beam_search:  # streaming: after each step's last beam too
            update = all(s.finished for s in state.seqs) or (req.streaming and chunk.index == params.n - 1)
            results = [self._beam_result(state, chunk)] if update else []
        elif chunk.finish_reason is None and (not req.streaming or not chunk.output_ids):
            results = []
        else:
            results = [self._sequence_result(state, i, chunk) for i in indices]
        return [Response(state.request_id, result=r, client_id=req.client_id) for r in results]

    def _finish_reason(self, chunk: OutputChunk) -> FinishReason:
        reason, details = chunk.finish_reason, chunk.finish_details
        if reason is None:
            return FinishReason.NOT_FINISHED
        if reason == "length":
            return FinishReason.LENGTH
        if reason == "abort":
            return FinishReason.TIMED_OUT if details and details.message == "timeout" else FinishReason.CANCELLED
        if details is not None and isinstance(details.matched_token, tuple):
            return FinishReason.STOP_WORDS
        return FinishReason.END_ID

    def _sequence_result(self, state: _RequestState, index: int, chunk: OutputChunk) -> Result:
        req, oc, seq = state.request, state.request.output_config, state.seqs[index]
        whole = not req.streaming or req.return_all_generated_tokens
        tokens = list(seq.token_ids) if whole else list(chunk.output_ids)
        if not req.streaming and not oc.exclude_input_from_output:
            tokens = list(req.input_token_ids) + tokens
        result = Result(
            is_final=all(s.finished for s in state.seqs),
            output_token_ids=[tokens],
            finish_reasons=[seq.finish_reason],
            sequence_index=index,
            is_sequence_final=seq.finished,
            decoding_iter=seq.decoding_iter,
        )
        if oc.return_log_probs:
            result.log_probs = [list(seq.log_probs) if whole else list(chunk.output_token_logprobs)]
            result.cum_log_probs = [sum(seq.log_probs)]
        if oc.return_generation_logits:
            rows = (
                seq.generation_logits
                if whole
                else [chunk.generation_logits]
                if chunk.generation_logits is not None
                else []
            )
            result.generation_logits = torch.cat(rows).unsqueeze(0) if rows else None
        for name, values in seq.generation_outputs.items():
            rows = (
                values
                if whole
                else ([chunk.additional_generation_outputs[name]] if chunk.additional_generation_outputs else [])
            )
            if rows:
                result.additional_outputs.append(AdditionalOutput(name, torch.cat(rows).unsqueeze(0)))
        self._attach_context(state, result)
        return result

    def _beam_result(self, state: _RequestState, chunk: OutputChunk) -> Result:
        req, oc = state.request, state.request.output_config
        prefix = [] if req.streaming or oc.exclude_input_from_output else list(req.input_token_ids)
        beams = state.seqs
        final = all(s.finished for s in beams)
        result = Result(
            is_final=final,
            output_token_ids=[prefix + s.token_ids for s in beams],
            finish_reasons=[s.finish_reason for s in beams],
            sequence_index=0,
            is_sequence_final=final,
            decoding_iter=max(s.decoding_iter for s in beams),
        )
        if oc.return_log_probs:
            result.log_probs = [list(s.log_probs) for s in beams]
            result.cum_log_probs = [sum(s.log_probs) for s in beams]
        if oc.return_generation_logits and all(s.generation_logits for s in beams):
            result.generation_logits = _stack_beams([torch.cat(s.generation_logits) for s in beams])
        for name in beams[0].generation_outputs:
            if all(s.generation_outputs.get(name) for s in beams):
                rows = _stack_beams([torch.cat(s.generation_outputs[name]) for s in beams])
                result.additional_outputs.append(AdditionalOutput(name, rows))
        self._attach_context(state, result)
        return result

    def _attach_context(self, state: _RequestState, result: Result) -> None:
        """Context outputs ride on the first Result that can carry them."""
        if state.context_sent or (state.context_logits is None and not state.context_outputs):
            return
        result.context_logits = state.context_logits
        wanted = {o.name for o in state.request.output_config.additional_model_outputs or [] if o.gather_context}
        for name, value in state.context_outputs.items():
            if name in wanted:
                result.additional_outputs.append(AdditionalOutput(name, value, context=True))
        state.context_sent = True

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

    # ------------------------------------------------------------------ stats
    def get_latest_iteration_stats(self) -> list:
        """IterationStats of the steps run since the last call (oldest first)."""
        history = self._engine.stats_history
        stats = []
        while history:
            stats.append(history.popleft())
        return stats

    def get_latest_request_stats(self) -> list[RequestStats]:
        """The requests in flight now, read inside the engine loop."""
        return self._engine.call(_request_stats)

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


def _stack_beams(rows: list[torch.Tensor]) -> torch.Tensor:
    """[beams, tokens, ...]: each beam's own rows, zero-padded after a beam that ended early."""
    longest = max(r.shape[0] for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros((longest - r.shape[0], *r.shape[1:]))]) for r in rows])
