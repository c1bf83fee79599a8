"""Executor result assembly: the engine's OutputChunks of one request -> its Responses (the executor spec's rules,
see petrel/executor/executor.py), with log probs, logits, additional outputs and perf metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from petrel.engine.output_processor import RequestOutputProcessor
from petrel.executor.types import (
    AdditionalOutput,
    FinishReason,
    KvCacheMetrics,
    Request,
    RequestPerfMetrics,
    Response,
    Result,
    TimingMetrics,
)
from petrel.outputs import KVFetchStats, OutputChunk
from petrel.sampling_params import SamplingParams


@dataclass
class _Sequence:
    """What a request accumulates per sequence until it finishes."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    generation_logits: list = field(default_factory=list)
    generation_outputs: dict = field(default_factory=dict)
    decoding_iter: int = 0
    finished: bool = False
    finish_reason: FinishReason = FinishReason.NOT_FINISHED


class RequestState:
    def __init__(
        self,
        request_id: int,
        request: Request,
        params: SamplingParams,
        processor: RequestOutputProcessor,
        block_size: int,
    ):
        self.request_id = request_id
        self.request = request
        self.params = params
        self.processor = processor  # its raw outputs -> chunks (token ids only: no detokenizing, no stop strings)
        self.seqs = [_Sequence() for _ in range(params.n)]
        self.context_logits = None
        self.context_outputs: dict = {}
        self.context_sent = False
        self.block_size = block_size
        self.timing = TimingMetrics(arrival_time=time.monotonic())
        self.cached_tokens = 0
        self.kv_fetch = KVFetchStats()

    def track(self, chunk: OutputChunk) -> None:
        """Perf metrics from a chunk: scheduling and token times, prefix-cache hits, KV tier fetches."""
        t = self.timing
        if chunk.scheduled_time is not None and t.first_scheduled_time is None:
            t.first_scheduled_time = chunk.scheduled_time
        if chunk.output_ids:
            t.first_token_time = t.first_token_time or chunk.timestamp
            t.last_token_time = chunk.timestamp
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.kv_fetch = chunk.kv_fetch or self.kv_fetch

    def perf_metrics(self) -> RequestPerfMetrics:
        reused = self.cached_tokens // self.block_size
        full = len(self.request.input_token_ids) // self.block_size
        missed = max(full - reused, 0)
        fetch = self.kv_fetch
        return RequestPerfMetrics(
            timing_metrics=TimingMetrics(**vars(self.timing)),
            kv_cache_metrics=KvCacheMetrics(
                reused,
                missed,
                reused / (reused + missed) if reused + missed else 0.0,
                fetch_time=fetch.seconds,
                fetched_blocks=fetch.blocks,
                fetched_bytes=fetch.bytes,
            ),
            num_generated_tokens=sum(len(s.token_ids) for s in self.seqs),
        )


def responses_for(state: RequestState, chunk: OutputChunk) -> list[Response]:
    req, params = state.request, state.params
    state.track(chunk)
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
        seq.finish_reason = finish_reason_of(chunk)
    if error is not None:
        return (
            [Response(state.request_id, error_msg=error, client_id=req.client_id)]
            if all(s.finished for s in state.seqs)
            else []
        )
    if params.use_beam_search:  # streaming: after each step's last beam too
        update = all(s.finished for s in state.seqs) or (req.streaming and chunk.index == params.n - 1)
        results = [_beam_result(state, chunk)] if update else []
    elif chunk.finish_reason is None and (not req.streaming or not chunk.output_ids):
        results = []
    else:
        results = [_sequence_result(state, i, chunk) for i in indices]
    return [Response(state.request_id, result=r, client_id=req.client_id) for r in results]


def finish_reason_of(chunk: OutputChunk) -> FinishReason:
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


def _sequence_result(state: RequestState, index: int, chunk: OutputChunk) -> Result:
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
            seq.generation_logits if whole else [chunk.generation_logits] if chunk.generation_logits is not None else []
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
    _attach_context(state, result)
    return result


def _beam_result(state: RequestState, chunk: OutputChunk) -> Result:
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
    _attach_context(state, result)
    return result


def _stack_beams(rows: list[torch.Tensor]) -> torch.Tensor:
    """[beams, tokens, ...]: each beam's own rows, zero-padded after a beam that ended early."""
    longest = max(r.shape[0] for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros((longest - r.shape[0], *r.shape[1:]))]) for r in rows])


def _attach_context(state: RequestState, result: Result) -> None:
    """Perf metrics go on every Result (when asked); context outputs ride on the first Result that can carry them."""
    if state.request.output_config.return_perf_metrics:
        result.request_perf_metrics = state.perf_metrics()
    if state.context_sent or (state.context_logits is None and not state.context_outputs):
        return
    result.context_logits = state.context_logits
    wanted = {o.name for o in state.request.output_config.additional_model_outputs or [] if o.gather_context}
    for name, value in state.context_outputs.items():
        if name in wanted:
            result.additional_outputs.append(AdditionalOutput(name, value, context=True))
    state.context_sent = True
