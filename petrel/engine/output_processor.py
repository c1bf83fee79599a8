"""One request's EngineOutputs -> OutputChunks, on the consumer's side (a caller's thread, the server's event loop),
never in the engine loop: incremental detokenization, stop strings, logprob lists, finish details.

A stop string is found here, after the engine already moved on: the consumer then tells the engine loop to end that
sequence (LLMEngine.finish_sequence) and drops whatever the engine produced for it meanwhile, so the visible output
ends exactly where it would have had the loop found the stop string itself.
"""

from __future__ import annotations

from petrel.engine.detokenizer import IncrementalDetokenizer
from petrel.engine.engine_output import EngineOutput  # noqa: F401 - defined there; imported from here by older code
from petrel.outputs import FinishDetails, OutputChunk


class RequestOutputProcessor:
    """Turns one request's raw outputs into OutputChunks, in order; one instance per request, used by one consumer
    at a time."""

    def __init__(self, request_id, tokenizer, prompt_token_ids: list[int], params):
        self.request_id = request_id
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.num_sequences = params.n
        self.finished: set[int] = set()  # sequences whose last chunk was made (later outputs of them are dropped)
        self._detokenizers: dict[int, IncrementalDetokenizer | None] = {}
        self._cumulative: dict[int, float] = {}  # per sequence, the sum of its kept tokens' logprobs

    @property
    def all_finished(self) -> bool:
        return len(self.finished) >= self.num_sequences

    @property
    def has_stop_strings(self) -> bool:
        """Whether this side may end a sequence (a stop string matched in its text)."""
        return bool(self.params.stop) and self.params.detokenize and self.tokenizer is not None

    def _detokenizer(self, index: int) -> IncrementalDetokenizer | None:
        if index not in self._detokenizers:
            p = self.params
            detok = None
            if p.detokenize and self.tokenizer is not None:
                context = self.prompt_token_ids
                if p.prompt_embedding_table is not None:  # prompt tuning's virtual ids are no tokenizer's tokens
                    context = [t for t in context if t < len(self.tokenizer)]
                detok = IncrementalDetokenizer(
                    self.tokenizer, context, p.skip_special_tokens, p.stop, p.include_stop_str_in_output
                )
            self._detokenizers[index] = detok
        return self._detokenizers[index]

    def process(self, out: EngineOutput) -> tuple[OutputChunk | None, str | None]:
        """(the chunk, the stop string when one matched: the caller then has the engine end the sequence).
        (None, None) for an output of a sequence already finished here (the engine had not heard of its stop
        string yet, or reports the end it was told)."""
        if out.index in self.finished:
            return None, None
        if out.replaces:  # a beam's whole output so far: its text starts over
            self._detokenizers.pop(out.index, None)
        detokenizer = self._detokenizer(out.index)
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
            request_id=out.request_id,
            index=out.index,
            output_ids=new_ids,
            text=text,
            finish_reason=finish_reason,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens - dropped,
            cached_tokens=out.num_cached_tokens,
            timestamp=out.timestamp,
            spec_verify_ct=out.spec_verify_ct,
            accept_draft_tokens=out.accept_draft_tokens,
            scheduled_time=out.scheduled_time,
            cumulative_logprob=self._cumulative_logprob(out, len(new_ids), dropped),
            replaces=out.replaces,
            context_logits=out.context_logits,
            generation_logits=out.generation_logits,
            additional_context_outputs=out.additional_context_outputs,
            additional_generation_outputs=out.additional_generation_outputs,
            disaggregated_params=out.disaggregated_params,
            kv_fetch=out.kv_fetch,
        )
        if out.new_logprobs is not None:
            new_logprobs = out.new_logprobs[: len(new_ids)]
            chunk.output_token_logprobs = [lp.logprob for lp in new_logprobs]
            chunk.output_token_ranks = [lp.rank for lp in new_logprobs]
            chunk.output_top_logprobs = [lp.top for lp in new_logprobs]
        if dropped and chunk.generation_logits is not None:
            chunk.generation_logits = chunk.generation_logits[: len(new_ids)]
        if out.prompt_logprobs is not None:
            first = self.prompt_token_ids[:1]
            chunk.input_token_logprobs = (
                [None] + [lp.logprob for lp in out.prompt_logprobs],
                first + [lp.token_id for lp in out.prompt_logprobs],
            )
            chunk.input_top_logprobs = [None] + [lp.top for lp in out.prompt_logprobs]
            chunk.input_token_ranks = [None] + [lp.rank for lp in out.prompt_logprobs]
        if finish_reason is not None:
            chunk.finish_details = FinishDetails(
                type=finish_reason,
                matched_token=stop_reason if isinstance(stop_reason, (int, tuple)) else None,
                matched_stop=stop_reason if isinstance(stop_reason, str) else None,
                message=out.abort_message,
            )
            self.finished.add(out.index)
            self._detokenizers.pop(out.index, None)
        return chunk, matched

    def _cumulative_logprob(self, out: EngineOutput, kept: int, dropped: int) -> float | None:
        """The sequence's cumulative logprob after this output: a beam's own score, else the running sum of its
        sampled tokens' logprobs (not those dropped after a stop string; a disaggregated request's first token,
        sampled by the context instance, has none)."""
        if out.cumulative_logprob is not None:
            return out.cumulative_logprob
        if out.sampled_logprobs is None:
            return self._cumulative.get(out.index)
        values = out.sampled_logprobs[: max(0, len(out.sampled_logprobs) - dropped)][-kept:] if kept else []
        total = self._cumulative.get(out.index, 0.0) + sum(values)
        self._cumulative[out.index] = total
        return total

    def fail(self, message: str) -> list[OutputChunk]:
        """End every sequence not finished yet with an abort carrying `message` (the consumer could not process
        this request's output; the caller aborts it in the engine)."""
        chunks = []
        for index in range(self.num_sequences):
            if index not in self.finished:
                self.finished.add(index)
                chunks.append(
                    OutputChunk(
                        self.request_id,
                        index,
                        [],
                        "",
                        "abort",
                        len(self.prompt_token_ids),
                        0,
                        0,
                        finish_details=FinishDetails("abort", message=message),
                    )
                )
        self._detokenizers.clear()
        return chunks
