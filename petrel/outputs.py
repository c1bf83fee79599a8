"""What petrel hands back: per-step OutputChunks (one stream for every API) and the RequestOutput built from them
(by petrel/request_output_builder.py, on the consumer's side)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

FinishReason = Literal["stop", "length", "timeout", "cancelled"]
AbortCode = Literal["cancelled", "timeout", "error"]
ABORT_CODES = ("cancelled", "timeout", "error")


class Logprob(NamedTuple):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]


@dataclass
class FinishDetails:
    """Why a sequence ended, in full: the matched stop token or string, or an abort's message."""

    type: Literal["stop", "length", "abort"]
    matched_token: int | tuple[int, ...] | None = None  # a stop token id, or a multi-token stop word
    matched_stop: str | None = None
    message: str | None = None  # for aborts: 'cancelled' or 'timeout' or an error text
    code: AbortCode | None = None  # for aborts: 'cancelled' | 'timeout' | 'error' (derived from message when unset)

    def __post_init__(self):
        if self.type == "abort" and self.code is None:
            self.code = self.message if self.message in ("cancelled", "timeout") else "error"
        if self.code is not None and self.code not in ABORT_CODES:
            raise ValueError(f"FinishDetails.code must be one of {ABORT_CODES}, got {self.code!r}")


@dataclass
class FunctionCall:
    """A tool call's function: its name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass
class ToolCall:
    """One tool call parsed out of a sequence's text (OpenAI's `message.tool_calls[i]`)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


@dataclass
class OutputChunk:
    """One step of one sequence's output: the gateway spec's fields plus what identifies the sequence."""

    request_id: Any
    index: int  # sequence index within the request
    output_ids: list[int]
    text: str  # text released this step (held back while a stop string may match)
    finish_reason: Literal["stop", "length", "abort"] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[float] = field(default_factory=list)
    finish_details: FinishDetails | None = None
    spec_verify_ct: int | None = None
    accept_draft_tokens: float | None = None
    input_token_logprobs: tuple[list[float | None], list[int]] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    output_token_ranks: list[int] | None = None  # rank of each sampled token (1 = most likely)
    input_token_ranks: list[int | None] | None = None
    timestamp: float = 0.0  # monotonic time the step ended
    scheduled_time: float | None = None  # monotonic time the request was first scheduled
    replaces: bool = False  # beam search: output_ids etc. are the whole output so far, replacing the earlier ones
    cumulative_logprob: float | None = None  # the sum of the output tokens' logprobs so far (a beam: its score)
    context_logits: Any = None  # [prompt_len, vocab], in the first chunk, when asked for
    generation_logits: Any = None  # [len(output_ids), vocab], when asked for
    additional_context_outputs: dict | None = None  # name -> [prompt_len, ...], in the first chunk
    additional_generation_outputs: dict | None = None  # name -> [len(output_ids), ...]
    disaggregated_params: Any = None  # a context-only request's DisaggregatedParams (its last chunk)
    kv_fetch: KVFetchStats | None = None  # its waits for KV blocks read from a slow tier so far (None: none)

    @property
    def error(self) -> str | None:
        """The message of an abort that is an error (not a cancel or a timeout), else None."""
        if self.finish_reason != "abort":
            return None
        message = self.finish_details.message if self.finish_details is not None else None
        return None if message in ("cancelled", "timeout") else message

    @property
    def completion_finish_reason(self) -> FinishReason | None:
        """The finish reason as CompletionOutput reports it: stop | length | timeout | cancelled (an abort is a
        timeout when it timed out, else cancelled)."""
        if self.finish_reason != "abort":
            return self.finish_reason
        return (
            "timeout" if self.finish_details is not None and self.finish_details.message == "timeout" else "cancelled"
        )

    @property
    def completion_stop_reason(self) -> int | tuple | str | None:
        """What stopped the sequence when it finished with 'stop': the stop string, else the stop token(s)."""
        details = self.finish_details
        if self.finish_reason != "stop" or details is None:
            return None
        return details.matched_stop if details.matched_stop is not None else details.matched_token

    def logprob_entries(self, decode: Callable[[int], str] | None = None) -> list[TokenLogprobs]:
        """This step's tokens' logprobs as the API reports them (empty when not asked for)."""
        if self.output_top_logprobs is None:
            return []
        return [
            logprob_entry(tok, lp, rank, top, decode)
            for tok, lp, rank, top in zip(
                self.output_ids, self.output_token_logprobs, self.output_token_ranks, self.output_top_logprobs
            )
        ]

    def prompt_logprob_entries(self, decode: Callable[[int], str] | None = None) -> list[TokenLogprobs | None] | None:
        """The prompt's logprobs as the API reports them (None for the first position), in the chunk that has them."""
        if self.input_token_logprobs is None:
            return None
        values, tokens = self.input_token_logprobs
        return [None] + [
            logprob_entry(tokens[i], values[i], self.input_token_ranks[i], self.input_top_logprobs[i], decode)
            for i in range(1, len(values))
        ]


def logprob_entry(
    token: int, logprob: float, rank: int, top, decode: Callable[[int], str] | None = None
) -> TokenLogprobs:
    """The sampled token's Logprob and its top alternatives' (ranked from 1), as the API reports them; with
    `decode`, each carries its token's text."""
    entry = {token: Logprob(logprob, rank, decode(token) if decode else None)}
    for r, (tid, tlp) in enumerate(top, start=1):
        if tid not in entry:
            entry[tid] = Logprob(tlp, r, decode(tid) if decode else None)
    return entry


@dataclass(frozen=True)
class KVFetchStats:
    """A request's waits for its KV blocks to be read from a slow tier (disk, the shared store): the seconds it was
    held back from admission, and the blocks and bytes read for it (petrel/engine/kv_tier_io.py)."""

    seconds: float = 0.0
    blocks: int = 0
    bytes: int = 0


@dataclass
class RequestPerfMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generated_tokens: int = 0
    request_path: str | None = None  # a TextGenerationRequest's request_path (normalized, capped)
    # petrel's own (no TensorRT-LLM name fits): the seconds the request waited before admission for its KV blocks
    # to be read from the disk tier or the shared KV store, and the blocks and bytes read for it (part of queue_time)
    kv_cache_fetch_time: float = 0.0
    kv_cache_fetched_blocks: int = 0
    kv_cache_fetched_bytes: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.last_token_time is None else self.last_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def throughput(self) -> float | None:
        e2e = self.e2e
        return self.num_generated_tokens / e2e if e2e else None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    generation_logits: Any = None
    additional_context_outputs: dict | None = None
    additional_generation_outputs: dict | None = None
    disaggregated_params: Any = None
    request_perf_metrics: RequestPerfMetrics | None = None
    spec_verify_ct: int | None = None  # speculative decoding: verify rounds so far
    accept_draft_tokens: float | None = None  # accepted draft tokens per verify round, once finished
    # a TextGenerationRequest with tools: the calls parsed out of `text` once the sequence finished (the server's
    # tool parser, petrel/serve/tool_parser.py); `text` stays the model's text as written. None without tools.
    tool_calls: list[ToolCall] | None = None
    # where the previous streamed snapshot ended, for the *_diff properties
    _last_text_len: int = field(default=0, repr=False)
    _last_token_len: int = field(default=0, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_len :]

    @property
    def logprobs_diff(self) -> list[TokenLogprobs]:
        return (self.logprobs or [])[self._last_token_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: Any
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    context_logits: Any = None
    disaggregated_params: Any = None  # context-only: where the decode instance fetches the prompt's KV
    request_perf_metrics: RequestPerfMetrics | None = None
    kv_transfer: Any = None  # generation-only: petrel.disagg.KVTransferStats of the KV fetch

    def snapshot(self) -> RequestOutput:
        """A copy that later steps do not change (lists copied, tensors shared)."""
        snap = copy.copy(self)
        snap.outputs = []
        for out in self.outputs:
            o = copy.copy(out)
            o.token_ids = list(out.token_ids)
            o.logprobs = None if out.logprobs is None else list(out.logprobs)
            o.request_perf_metrics = copy.copy(out.request_perf_metrics)
            snap.outputs.append(o)
        snap.request_perf_metrics = copy.copy(self.request_perf_metrics)
        return snap
