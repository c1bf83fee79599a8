"""petrel's per-step OutputChunks -> trtllm GenerateResponses: a GenerateStreamChunk per step and sequence (delta
token ids, counts so far, the step's logprobs), then exactly one GenerateComplete per sequence (all its tokens,
finish reason, the matched stop, counts, logprobs, prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from smg_grpc_proto import trtllm_service_pb2 as pb

from petrel.outputs import OutputChunk


def token_logprobs(chunk: OutputChunk) -> list:
    """The chunk's output tokens' TokenLogprobs (empty when logprobs were not asked for)."""
    if chunk.output_top_logprobs is None:
        return []
    return [
        pb.TokenLogprob(
            token_id=tok,
            logprob=lp,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top],
        )
        for tok, lp, top in zip(chunk.output_ids, chunk.output_token_logprobs, chunk.output_top_logprobs)
    ]


def prompt_logprobs(chunk: OutputChunk) -> list:
    """The prompt's TokenLogprobs from the second prompt token on (the first has none)."""
    values, tokens = chunk.input_token_logprobs
    tops = chunk.input_top_logprobs or [None] * len(values)
    return [
        pb.TokenLogprob(
            token_id=tokens[i],
            logprob=values[i],
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in tops[i] or []],
        )
        for i in range(1, len(values))
    ]


def _float32_bytes(tensor) -> bytes:
    """A logits tensor as row-major little-endian float32 bytes ([rows, vocab])."""
    return np.ascontiguousarray(tensor.detach().float().cpu().numpy(), dtype="<f4").tobytes()


@dataclass
class _Sequence:
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    generation_logits: list = field(default_factory=list)
    done: bool = False


class ResponseBuilder:
    """Turns one request's OutputChunks into GenerateResponses. `stream`: a GenerateStreamChunk per step (beam
    search never streams: its chunks replace a beam's whole output). `keep_stop_token`: a matched stop token id
    stays in the token ids (include_stop_token_in_output), else it is stripped from them (the counts are the
    engine's and still include it)."""

    def __init__(self, request_id: str, stream: bool, keep_stop_token: bool = False):
        self.request_id = request_id
        self.stream = stream
        self.keep_stop_token = keep_stop_token
        self.sequences: dict[int, _Sequence] = {}
        self.prompt_logprobs: list | None = None  # from the second prompt token on
        self.prompt_first_token: int | None = None
        self.context_logits: bytes | None = None
        self.aborted = False

    @property
    def finished(self) -> bool:
        return self.aborted or (bool(self.sequences) and all(s.done for s in self.sequences.values()))

    def _strip(self, chunk: OutputChunk) -> int:
        """How many trailing ids of this chunk are a matched stop token to leave out."""
        details = chunk.finish_details
        if self.keep_stop_token or chunk.finish_reason != "stop" or details is None:
            return 0
        if (
            isinstance(details.matched_token, int)
            and chunk.output_ids
            and chunk.output_ids[-1] == details.matched_token
        ):
            return 1
        return 0

    def add(self, chunk: OutputChunk) -> list:
        """The GenerateResponses this chunk makes (none once the request was aborted)."""
        if chunk.finish_reason == "abort":
            self.aborted = True
            return []
        seq = self.sequences.setdefault(chunk.index, _Sequence())
        if chunk.input_token_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(chunk)
            self.prompt_first_token = chunk.input_token_logprobs[1][0]
        if chunk.context_logits is not None:
            self.context_logits = _float32_bytes(chunk.context_logits)
        drop = self._strip(chunk)
        ids = chunk.output_ids[: len(chunk.output_ids) - drop]
        logprobs = token_logprobs(chunk)[: len(ids)]
        if chunk.replaces:
            seq.ids, seq.logprobs, seq.generation_logits = [], [], []
        seq.ids += ids
        seq.logprobs += logprobs
        if chunk.generation_logits is not None:
            seq.generation_logits.append(chunk.generation_logits[: len(ids)])
        out = []
        if self.stream and not chunk.replaces and ids:
            out.append(self._chunk(chunk, ids, logprobs))
        if chunk.finish_reason is not None:
            seq.done = True
            out.append(self._complete(chunk, seq))
        return out

    def _chunk(self, chunk: OutputChunk, ids: list[int], logprobs: list) -> pb.GenerateResponse:
        return pb.GenerateResponse(
            request_id=self.request_id,
            chunk=pb.GenerateStreamChunk(
                token_ids=ids,
                sequence_index=chunk.index,
                prompt_tokens=chunk.prompt_tokens,
                completion_tokens=chunk.completion_tokens,
                cached_tokens=chunk.cached_tokens,
                logprobs=logprobs,
            ),
        )

    def _complete(self, chunk: OutputChunk, seq: _Sequence) -> pb.GenerateResponse:
        done = pb.GenerateComplete(
            output_token_ids=seq.ids,
            sequence_index=chunk.index,
            finish_reason=chunk.finish_reason,
            prompt_tokens=chunk.prompt_tokens,
            completion_tokens=chunk.completion_tokens,
            cached_tokens=chunk.cached_tokens,
            logprobs=seq.logprobs,
            prompt_logprobs=self.prompt_logprobs or [],
        )
        details = chunk.finish_details
        if details is not None and details.matched_stop is not None:
            done.matched_stop_str = details.matched_stop
        elif details is not None and isinstance(details.matched_token, int):
            done.matched_token_id = details.matched_token
        if self.context_logits is not None:
            done.context_logits = self.context_logits
        if seq.generation_logits:
            import torch

            done.generation_logits = _float32_bytes(torch.cat(seq.generation_logits))
        return pb.GenerateResponse(request_id=self.request_id, complete=done)
