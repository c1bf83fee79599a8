"""Engine-core outputs -> OutputChunks: detokenize, check stop strings, format logprobs, keep counts."""
from __future__ import annotations

from dataclasses import dataclass, field

from petrel.engine.detokenizer import IncrementalDetokenizer
from petrel.engine.sampler import TokenLogprobs
from petrel.outputs import FinishDetails, OutputChunk


@dataclass
class EngineOutput:
    """One sequence's result of one step, as the core reports it (plain data, could cross processes)."""
    request_id: object
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None   # for prompt positions 1.. (position 0 has none)
    finish_reason: str | None = None     # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None
    abort_message: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timestamp: float = 0.0
    scheduled_time: float | None = None  # when the request was first scheduled (monotonic)
    cumulative_logprob: float | None = None   # beam search: the beam's sum of logprobs
    context_logits: object = None              # [prompt_len, vocab] tensor, once, when asked for
    generation_logits: object = None           # [len(new_token_ids), vocab] tensor, when asked for
    additional_context_outputs: dict | None = None
    additional_generation_outputs: dict | None = None
    spec_verify_ct: int | None = None          # speculative decoding: verify rounds so far
    accept_draft_tokens: float | None = None   # accepted draft tokens per verify round, on the final output
    disaggregated_params: object = None        # a context-only request's DisaggregatedParams, on its output


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    params: object
    detokenizers: dict[int, IncrementalDetokenizer | None] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[object, _RequestState] = {}

    def add_request(self, request_id, prompt_token_ids: list[int], params) -> None:
        self.requests[request_id] = _RequestState(prompt_token_ids, params)

    def _detokenizer(self, req: _RequestState, index: int) -> IncrementalDetokenizer | None:
        if index not in req.detokenizers:
            p = req.params
            detok = None
            if p.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                               p.stop, p.include_stop_str_in_output)
            req.detokenizers[index] = detok
        return req.detokenizers[index]

    def process(self, out: EngineOutput) -> tuple[OutputChunk, str | None]:
        """Returns the chunk, and the stop string when one matched (the caller then ends the sequence)."""
        req = self.requests[out.request_id]
        detokenizer = self._detokenizer(req, out.index)
        matched = None
        text = ""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        new_ids, dropped = list(out.new_token_ids), 0
        if detokenizer is not None:
            if new_ids:
                matched = detokenizer.add_tokens(new_ids)
                if matched is not None:
                    finish_reason, stop_reason = "stop", matched
                    # several tokens in one step (speculative decoding): none after the stop string's
                    kept = detokenizer.num_tokens_added
                    new_ids, dropped = new_ids[:kept], len(new_ids) - kept
            text = detokenizer.release(finished=finish_reason is not None)
        chunk = OutputChunk(
            request_id=out.request_id, index=out.index, output_ids=new_ids, text=text,
            finish_reason=finish_reason, prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens - dropped, cached_tokens=out.num_cached_tokens,
            timestamp=out.timestamp, spec_verify_ct=out.spec_verify_ct,
            accept_draft_tokens=out.accept_draft_tokens,
            scheduled_time=out.scheduled_time, cumulative_logprob=out.cumulative_logprob,
            context_logits=out.context_logits, generation_logits=out.generation_logits,
            additional_context_outputs=out.additional_context_outputs,
            additional_generation_outputs=out.additional_generation_outputs,
            disaggregated_params=out.disaggregated_params)
        if out.new_logprobs is not None:
            new_logprobs = out.new_logprobs[:len(new_ids)]
            chunk.output_token_logprobs = [lp.logprob for lp in new_logprobs]
            chunk.output_token_ranks = [lp.rank for lp in new_logprobs]
            chunk.output_top_logprobs = [lp.top for lp in new_logprobs]
        if dropped and chunk.generation_logits is not None:
            chunk.generation_logits = chunk.generation_logits[:len(new_ids)]
        if out.prompt_logprobs is not None:
            first = req.prompt_token_ids[:1]
            chunk.input_token_logprobs = ([None] + [lp.logprob for lp in out.prompt_logprobs],
                                          first + [lp.token_id for lp in out.prompt_logprobs])
            chunk.input_top_logprobs = [None] + [lp.top for lp in out.prompt_logprobs]
            chunk.input_token_ranks = [None] + [lp.rank for lp in out.prompt_logprobs]
        if finish_reason is not None:
            chunk.finish_details = FinishDetails(
                type=finish_reason,
                matched_token=stop_reason if isinstance(stop_reason, (int, tuple)) else None,
                matched_stop=stop_reason if isinstance(stop_reason, str) else None,
                message=out.abort_message)
            req.finished.add(out.index)
            if len(req.finished) == req.params.n:
                del self.requests[out.request_id]
        return chunk, matched

    def request_done(self, request_id) -> None:
        self.requests.pop(request_id, None)
