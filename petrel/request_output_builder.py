"""OutputChunks -> RequestOutput, on the consumer's side: the final result, and streamed updates that cost what
they added rather than the whole output so far.

Each sequence's output is a SequenceHistory, only ever appended to (a streamed beam's whole output is replaced
each step by a new SequenceHistory, so earlier updates keep reading theirs). A streamed update's CompletionOutputs are
StreamedCompletionOutputs: their `*_diff` properties read what the update added, and `text`, `token_ids`,
`logprobs` and the generation outputs read the history up to that update when first asked for. So updates are
built without copying, and an update never changes after later steps. The final result copies once.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from petrel.disagg.requests import context_params
from petrel.outputs import (
    CompletionOutput,
    FunctionCall,
    OutputChunk,
    RequestOutput,
    RequestPerfMetrics,
    TokenLogprobs,
    ToolCall,
)
from petrel.request_events import FinishedRequest
from petrel.serve.tool_parser import parse_all


class HistoryMark(NamedTuple):
    """How far a sequence's history reached at one update."""

    tokens: int = 0
    pieces: int = 0  # text pieces
    logit_chunks: int = 0  # chunks of generation logits
    extra_chunks: tuple = ()  # (name, chunks) of each additional generation output
    history: int = 0  # which history of the sequence (a streamed beam's is replaced each step)


_START = HistoryMark()


class _Rows:
    """Tensors appended a step at a time, concatenated only when read (and then kept concatenated)."""

    def __init__(self):
        self._pending: list = []
        self._whole = None
        self._row_ends: list[int] = []  # rows in total after each chunk

    def __len__(self) -> int:
        return len(self._row_ends)

    def append(self, rows) -> None:
        self._pending.append(rows)
        self._row_ends.append((self._row_ends[-1] if self._row_ends else 0) + rows.shape[0])

    def upto(self, chunks: int):
        """The first `chunks` chunks' rows as one tensor (None for none)."""
        if chunks == 0:
            return None
        if self._pending:
            import torch

            self._whole = torch.cat(([self._whole] if self._whole is not None else []) + self._pending)
            self._pending = []
        end = self._row_ends[chunks - 1]
        return self._whole if end == self._whole.shape[0] else self._whole[:end]


class SequenceHistory:
    """One sequence's output so far (append-only) and where it stands."""

    def __init__(self, index: int):
        self.index = index
        self.keep = True  # False: token ids and counts only (a consumer that builds its own view of the chunks)
        self.token_ids: list[int] = []
        self.text_pieces: list[str] = []
        self.logprobs: list[TokenLogprobs] | None = None
        self.logits = _Rows()
        self.extras: dict[str, _Rows] = {}
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.spec_verify_ct: int | None = None
        self.accept_draft_tokens: float | None = None
        self.additional_context_outputs: dict | None = None
        self.tool_calls: list[ToolCall] | None = None
        self._joined, self._joined_pieces = "", 0
        self.generation = 0  # how many histories this sequence had before this one

    def mark(self) -> HistoryMark:
        extras = tuple((name, len(rows)) for name, rows in self.extras.items()) if self.extras else ()
        return HistoryMark(len(self.token_ids), len(self.text_pieces), len(self.logits), extras, self.generation)

    def successor(self) -> SequenceHistory:
        """An empty history in this one's place (a streamed beam's whole output comes next)."""
        new = SequenceHistory(self.index)
        new.keep, new.generation = self.keep, self.generation + 1
        new.additional_context_outputs = self.additional_context_outputs
        return new

    def text(self, pieces: int | None = None) -> str:
        """The text of the first `pieces` pieces (all by default); joined once, extended as it grows."""
        n = len(self.text_pieces) if pieces is None else pieces
        if n < self._joined_pieces:
            return "".join(self.text_pieces[:n])
        if n > self._joined_pieces:
            self._joined += "".join(self.text_pieces[self._joined_pieces : n])
            self._joined_pieces = n
        return self._joined

    def text_between(self, start: int, end: int) -> str:
        return "".join(self.text_pieces[start:end])

    def generation_outputs(self, mark: HistoryMark | None = None) -> dict | None:
        counts = dict(mark.extra_chunks) if mark is not None else {n: len(r) for n, r in self.extras.items()}
        outputs = {name: self.extras[name].upto(k) for name, k in counts.items() if k}
        return outputs or None

    def drop_history(self) -> None:
        self.keep = False
        self.text_pieces, self._joined, self._joined_pieces = [], "", 0
        self.logprobs = None
        self.logits, self.extras = _Rows(), {}


def _viewed(name: str, read: Callable):
    """A CompletionOutput field a streamed update reads from its history when first used (then kept; settable)."""

    def get(self):
        values = self.__dict__
        if name not in values:
            values[name] = read(self._history, self._upto)
        return values[name]

    def set(self, value) -> None:
        self.__dict__[name] = value

    return property(get, set)


class StreamedCompletionOutput(CompletionOutput):
    """One streamed update of a sequence: a CompletionOutput whose cumulative fields are read from the sequence's
    history up to this update when first used, and whose *_diff properties are what this update added."""

    def __init__(self, *args, **kwargs):  # as a plain CompletionOutput (dataclasses.replace, copies)
        self._history = None
        super().__init__(*args, **kwargs)

    @classmethod
    def view(cls, history: SequenceHistory, since: HistoryMark, upto: HistoryMark, **fields):
        self = cls.__new__(cls)
        self.__dict__.update(fields, _history=history, _since=since, _upto=upto, _last_text_len=0, _last_token_len=0)
        return self

    text = _viewed("text", lambda h, m: h.text(m.pieces))
    token_ids = _viewed("token_ids", lambda h, m: h.token_ids[: m.tokens])
    logprobs = _viewed("logprobs", lambda h, m: None if h.logprobs is None else h.logprobs[: m.tokens])
    generation_logits = _viewed("generation_logits", lambda h, m: h.logits.upto(m.logit_chunks))
    additional_generation_outputs = _viewed("additional_generation_outputs", lambda h, m: h.generation_outputs(m))

    @property
    def length(self) -> int:
        return self._upto.tokens if self._history is not None else len(self.token_ids)

    @property
    def text_diff(self) -> str:
        if self._history is None:
            return CompletionOutput.text_diff.fget(self)
        return self._history.text_between(self._since.pieces, self._upto.pieces)

    @property
    def token_ids_diff(self) -> list[int]:
        if self._history is None:
            return CompletionOutput.token_ids_diff.fget(self)
        return self._history.token_ids[self._since.tokens : self._upto.tokens]

    @property
    def logprobs_diff(self) -> list[TokenLogprobs]:
        if self._history is None:
            return CompletionOutput.logprobs_diff.fget(self)
        return (self._history.logprobs or [])[self._since.tokens : self._upto.tokens]


class RequestOutputBuilder:
    """One request's chunks, applied in order, and the RequestOutputs read from them."""

    def __init__(
        self,
        request_id,
        prompt: str | None,
        prompt_token_ids: list[int],
        params,
        decode_token: Callable[[int], str],
        arrival_time: float = 0.0,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.decode_token = decode_token
        self.sequences = [SequenceHistory(i) for i in range(params.n)]
        self.metrics = RequestPerfMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.context_logits = None
        self.disaggregated_params = None
        self.kv_transfer = None  # generation-only: the KV fetch's KVTransferStats
        self.kv_endpoint: str | None = None  # context-only: this instance's KV transfer server
        self.error: str | None = None  # an abort's message when it is an error
        self.echo_chars = 0  # echo: each sequence's text starts with this many characters of prompt text
        self.parse_tools = False  # tools: parse each finished sequence's text for tool calls
        self.finished = False
        self.version = 0  # chunks applied

    def echo(self, prompt_text: str) -> None:
        """Start every sequence's text with the prompt's text (a TextGenerationRequest's echo); before any chunk."""
        for seq in self.sequences:
            seq.text_pieces.insert(0, prompt_text)
        self.echo_chars = len(prompt_text)

    def drop_history(self) -> None:
        """Keep token ids and counts only from now on (no text, logprobs or logits): for a consumer that streams
        the chunks and builds its own view of them."""
        for seq in self.sequences:
            seq.drop_history()

    # ------------------------------------------------------------------ chunks in
    def apply(self, chunk: OutputChunk) -> None:
        m = self.metrics
        if chunk.scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = chunk.scheduled_time
        seq = self.sequences[chunk.index]
        added = len(chunk.output_ids)
        if chunk.replaces and seq.finish_reason is None:
            added -= len(seq.token_ids)
            seq = self.sequences[chunk.index] = seq.successor()
        if seq.finish_reason is None:
            self._apply_to(seq, chunk)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.cached_tokens)
        if chunk.kv_fetch is not None:
            m.kv_cache_fetch_time = chunk.kv_fetch.seconds
            m.kv_cache_fetched_blocks, m.kv_cache_fetched_bytes = chunk.kv_fetch.blocks, chunk.kv_fetch.bytes
        if chunk.context_logits is not None:
            self.context_logits = chunk.context_logits
        if chunk.disaggregated_params is not None:  # the engine's PromptHandoff, in the API's terms
            self.disaggregated_params = context_params(chunk.disaggregated_params, self.kv_endpoint)
        if chunk.additional_context_outputs:
            for s in self.sequences:
                s.additional_context_outputs = dict(chunk.additional_context_outputs)
        if chunk.input_token_logprobs is not None and seq.keep:
            self.prompt_logprobs = chunk.prompt_logprob_entries(self.decode_token)
        if chunk.output_ids:
            m.first_token_time = m.first_token_time or chunk.timestamp
            m.last_token_time = chunk.timestamp
            m.num_generated_tokens += max(added, 0)
        self.finished = all(s.finish_reason is not None for s in self.sequences)
        self.version += 1

    def _apply_to(self, seq: SequenceHistory, chunk: OutputChunk) -> None:
        seq.token_ids.extend(chunk.output_ids)
        if seq.keep:
            if chunk.text:
                seq.text_pieces.append(chunk.text)
            if chunk.generation_logits is not None:
                seq.logits.append(chunk.generation_logits)
            for name, value in (chunk.additional_generation_outputs or {}).items():
                seq.extras.setdefault(name, _Rows()).append(value)
        if chunk.output_top_logprobs is not None:
            if seq.cumulative_logprob is None:
                seq.cumulative_logprob = 0.0
                seq.logprobs = [] if seq.keep else None
            if seq.logprobs is not None:
                seq.logprobs += chunk.logprob_entries(self.decode_token)
            for lp in chunk.output_token_logprobs:
                seq.cumulative_logprob += lp
        if chunk.cumulative_logprob is not None:  # the sum so far (a beam: its own score)
            seq.cumulative_logprob = chunk.cumulative_logprob
        if chunk.spec_verify_ct is not None:
            seq.spec_verify_ct = chunk.spec_verify_ct
        if chunk.accept_draft_tokens is not None:
            seq.accept_draft_tokens = chunk.accept_draft_tokens
        if chunk.finish_reason is not None:
            self._finish(seq, chunk)

    def _finish(self, seq: SequenceHistory, chunk: OutputChunk) -> None:
        seq.finish_reason = chunk.completion_finish_reason
        seq.stop_reason = chunk.completion_stop_reason
        if self.parse_tools and seq.keep:
            calls = parse_all(seq.text()[self.echo_chars :]).calls
            seq.tool_calls = [
                ToolCall(f"call_{secrets.token_hex(12)}", FunctionCall(c.name, c.arguments)) for c in calls
            ]
        if chunk.error is not None:
            self.error = chunk.error

    # ------------------------------------------------------------------ RequestOutputs out
    def partial(self, since: list[HistoryMark] | None = None) -> tuple[RequestOutput, list[HistoryMark]]:
        """A streamed update: what was added since `since` (the marks of the previous update; None: from the
        start), and the marks of this one."""
        marks = [seq.mark() for seq in self.sequences]
        since = [a if a.history == b.history else _START for a, b in zip(since or [_START] * len(marks), marks)]
        metrics = self._metrics_copy()
        outputs = [
            StreamedCompletionOutput.view(seq, a, b, **self._sequence_fields(seq, metrics))
            for seq, a, b in zip(self.sequences, since, marks)
        ]
        return self._request_output(outputs, metrics), marks

    def result(self) -> RequestOutput:
        """The output so far as plain lists and tensors of its own (the final result, once finished)."""
        metrics = self._metrics_copy()
        outputs = [
            CompletionOutput(
                text=seq.text(),
                token_ids=list(seq.token_ids),
                logprobs=None if seq.logprobs is None else list(seq.logprobs),
                generation_logits=seq.logits.upto(len(seq.logits)),
                additional_generation_outputs=seq.generation_outputs(),
                **self._sequence_fields(seq, metrics),
            )
            for seq in self.sequences
        ]
        return self._request_output(outputs, metrics)

    def finished_request(self) -> FinishedRequest:
        """What the request's end reports (petrel/request_events.py): kept whatever the caller asked to keep."""
        return FinishedRequest(
            tuple(seq.finish_reason for seq in self.sequences),
            len(self.prompt_token_ids),
            sum(len(seq.token_ids) for seq in self.sequences),
            replace(self.metrics),
            self.error,
        )

    def _metrics_copy(self) -> RequestPerfMetrics | None:
        return replace(self.metrics) if self.params.return_perf_metrics else None

    def _sequence_fields(self, seq: SequenceHistory, metrics: RequestPerfMetrics | None) -> dict:
        return {
            "index": seq.index,
            "cumulative_logprob": seq.cumulative_logprob,
            "prompt_logprobs": self.prompt_logprobs,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "additional_context_outputs": seq.additional_context_outputs,
            "disaggregated_params": self.disaggregated_params,
            "request_perf_metrics": metrics,
            "spec_verify_ct": seq.spec_verify_ct,
            "accept_draft_tokens": seq.accept_draft_tokens,
            "tool_calls": None if seq.tool_calls is None else list(seq.tool_calls),
        }

    def _request_output(self, outputs: list[CompletionOutput], metrics: RequestPerfMetrics | None) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            context_logits=self.context_logits,
            disaggregated_params=self.disaggregated_params,
            request_perf_metrics=metrics,
            kv_transfer=self.kv_transfer,
        )
