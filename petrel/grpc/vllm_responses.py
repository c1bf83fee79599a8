"""petrel's OutputChunks -> the vLLM-protocol service's GenerateResponses (smg's `vllm.grpc.engine`): the same
stream as the trtllm service's (responses.py), in vLLM's shapes. The gateway sums a vLLM stream's token counts
from its chunks, so the ids keep a matched stop token (as vLLM's do) and each chunk counts its own tokens; a
context-only (prefill) request's Complete carries its DisaggregatedParams as kv_transfer_params_json."""

from __future__ import annotations

import json

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from petrel.disagg.requests import context_params
from petrel.grpc.responses import ResponseBuilder


def output_logprobs(entries: list) -> vpb.OutputLogProbs:
    """trtllm TokenLogprobs (responses.token_logprobs) in vLLM's shape."""
    return vpb.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=[
            vpb.TopLogProbs(values=[t.logprob for t in e.top_logprobs], token_ids=[t.token_id for t in e.top_logprobs])
            for e in entries
        ],
    )


def input_logprobs(first_token: int, entries: list) -> vpb.InputLogProbs:
    """The prompt's logprobs: none for its first token, then trtllm TokenLogprobs in vLLM's shape."""
    return vpb.InputLogProbs(
        token_logprobs=[vpb.InputTokenLogProb()] + [vpb.InputTokenLogProb(value=e.logprob) for e in entries],
        token_ids=[first_token] + [e.token_id for e in entries],
        top_logprobs=[vpb.TopLogProbs()]
        + [
            vpb.TopLogProbs(values=[t.logprob for t in e.top_logprobs], token_ids=[t.token_id for t in e.top_logprobs])
            for e in entries
        ],
    )


class VllmResponseBuilder(ResponseBuilder):
    """`kv_endpoint`: this engine's KV transfer server ("host:port"), which a context-only request's
    DisaggregatedParams name for the decode worker."""

    def __init__(self, request_id: str, stream: bool, logprobs: bool, kv_endpoint: str | None = None):
        super().__init__(request_id, stream, keep_stop_token=True)
        self.logprobs = logprobs
        self.kv_endpoint = kv_endpoint
        self.handoff = None  # a context-only request's pinned prompt (the engine's record)
        self._prompt_sent = False

    def add(self, chunk) -> list:
        if chunk.disaggregated_params is not None:
            self.handoff = chunk.disaggregated_params
        return super().add(chunk)

    def _input_logprobs(self):
        if self.prompt_logprobs is None:
            return None
        return input_logprobs(self.prompt_first_token, self.prompt_logprobs)

    def _chunk(self, chunk, ids, logprobs) -> vpb.GenerateResponse:
        out = vpb.GenerateStreamChunk(
            token_ids=ids,
            prompt_tokens=chunk.prompt_tokens,
            completion_tokens=len(ids),
            cached_tokens=chunk.cached_tokens,
            index=chunk.index,
        )
        if self.logprobs:
            out.output_logprobs.CopyFrom(output_logprobs(logprobs))
        prompt = self._input_logprobs()
        if prompt is not None and not self._prompt_sent:
            out.input_logprobs.CopyFrom(prompt)
            self._prompt_sent = True
        return vpb.GenerateResponse(chunk=out)

    def _complete(self, chunk, seq) -> vpb.GenerateResponse:
        done = vpb.GenerateComplete(
            output_ids=seq.ids,
            finish_reason=chunk.finish_reason,
            prompt_tokens=chunk.prompt_tokens,
            completion_tokens=chunk.completion_tokens,
            cached_tokens=chunk.cached_tokens,
            index=chunk.index,
        )
        if self.logprobs:
            done.output_logprobs.CopyFrom(output_logprobs(seq.logprobs))
        prompt = self._input_logprobs()
        if prompt is not None:
            done.input_logprobs.CopyFrom(prompt)
        details = chunk.finish_details
        if details is not None and details.matched_stop is not None:
            done.matched_stop_str = details.matched_stop
        elif details is not None and isinstance(details.matched_token, int):
            done.matched_token_id = details.matched_token
        if self.handoff is not None:
            params = context_params(self.handoff, self.kv_endpoint).to_dict()
            params.pop("request_type", None)
            done.kv_transfer_params_json = json.dumps(params)
        return vpb.GenerateResponse(complete=done)
