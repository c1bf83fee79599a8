"""The LLM API: generate, generate_async (a RequestFuture you can wait on, await, or iterate), chat."""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from typing import Any, Sequence as Seq

import torch

from petrel.config import EngineConfig
from petrel.disagg import DisaggregatedParams
from petrel.disagg import requests as disagg
from petrel.engine.llm_engine import LLMEngine
from petrel.lora import LoRARequest
from petrel.model.tokenizer import chat_prompt
from petrel.outputs import CompletionOutput, Logprob, OutputChunk, RequestOutput, RequestPerfMetrics
from petrel.sampling_params import SamplingParams
from petrel.text_request import TextGenerationRequest

PromptType = str | list[int]


class RequestFuture:
    """The handle of one request: ``result(timeout)``, ``await``, ``for partial in f``, ``async for``, ``abort()``."""

    def __init__(self, request_id: int, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, streaming: bool, engine: LLMEngine):
        self.request_id = request_id
        self.streaming = streaming
        self._engine = engine
        self._params = params
        self._tokenizer = engine.tokenizer
        self._output = RequestOutput(request_id, prompt, list(prompt_token_ids),
                                     [CompletionOutput(i) for i in range(params.n)])
        self._metrics = RequestPerfMetrics(arrival_time=0.0)
        self._version = 0
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._error: str | None = None
        self._chunks: list[OutputChunk] = []
        self._kv_endpoint: str | None = None     # context-only: this instance's KV transfer server

    # ------------------------------------------------------------------ fed by the engine thread
    def _on_chunk(self, chunk: OutputChunk) -> None:
        with self._cond:
            self._chunks.append(chunk)
            self._apply(chunk)
            self._version += 1
            self._cond.notify_all()
            waiters = list(self._async_waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass  # that event loop is closed

    def _apply(self, chunk: OutputChunk) -> None:
        out = self._output
        m = self._metrics
        if chunk.scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = chunk.scheduled_time
        outputs = out.outputs if chunk.index < 0 else [out.outputs[chunk.index]]
        for co in outputs:
            if co.finish_reason is not None:
                continue
            self._apply_to(co, chunk)
        out.num_cached_tokens = max(out.num_cached_tokens, chunk.cached_tokens)
        if chunk.context_logits is not None:
            out.context_logits = chunk.context_logits
        if chunk.disaggregated_params is not None:
            chunk.disaggregated_params.ctx_info_endpoint = self._kv_endpoint
            out.disaggregated_params = chunk.disaggregated_params
            for co in out.outputs:
                co.disaggregated_params = chunk.disaggregated_params
        if chunk.additional_context_outputs:
            for co in out.outputs:
                co.additional_context_outputs = dict(chunk.additional_context_outputs)
        if chunk.input_token_logprobs is not None:
            out.prompt_logprobs = self._prompt_logprobs(chunk)
            for co in out.outputs:
                co.prompt_logprobs = out.prompt_logprobs
        if chunk.output_ids:
            m.first_token_time = m.first_token_time or chunk.timestamp
            m.last_token_time = chunk.timestamp
            m.num_generated_tokens += len(chunk.output_ids)
        out.finished = all(co.finish_reason is not None for co in out.outputs)

    def _apply_to(self, co: CompletionOutput, chunk: OutputChunk) -> None:
        co.token_ids.extend(chunk.output_ids)
        co.text += chunk.text
        if chunk.generation_logits is not None:
            co.generation_logits = chunk.generation_logits if co.generation_logits is None else \
                torch.cat([co.generation_logits, chunk.generation_logits])
        for name, value in (chunk.additional_generation_outputs or {}).items():
            outputs = dict(co.additional_generation_outputs or {})   # a new dict: snapshots keep theirs
            outputs[name] = value if name not in outputs else torch.cat([outputs[name], value])
            co.additional_generation_outputs = outputs
        if chunk.output_top_logprobs is not None:
            if co.logprobs is None:
                co.logprobs, co.cumulative_logprob = [], 0.0
            for tok, lp, rank, top in zip(chunk.output_ids, chunk.output_token_logprobs,
                                          chunk.output_token_ranks, chunk.output_top_logprobs):
                co.logprobs.append(self._logprob_dict(tok, lp, rank, top))
                co.cumulative_logprob += lp
        if chunk.cumulative_logprob is not None:      # beam search: the beam's own score
            co.cumulative_logprob = chunk.cumulative_logprob
        if chunk.spec_verify_ct is not None:
            co.spec_verify_ct = chunk.spec_verify_ct
        if chunk.accept_draft_tokens is not None:
            co.accept_draft_tokens = chunk.accept_draft_tokens
        if chunk.finish_reason is not None:
            details = chunk.finish_details
            if chunk.finish_reason == "abort":
                message = details.message if details else None
                co.finish_reason = "timeout" if message == "timeout" else "cancelled"
                if message not in ("timeout", "cancelled"):
                    self._error = message
            else:
                co.finish_reason = chunk.finish_reason
                if details is not None and chunk.finish_reason == "stop":
                    co.stop_reason = details.matched_stop if details.matched_stop is not None else details.matched_token

    def _decode_token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _logprob_dict(self, token: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        entry = {token: Logprob(logprob, rank, self._decode_token(token))}
        for r, (tid, tlp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(tlp, r, self._decode_token(tid))
        return entry

    def _prompt_logprobs(self, chunk: OutputChunk):
        values, tokens = chunk.input_token_logprobs
        result = [None]
        for i in range(1, len(values)):
            result.append(self._logprob_dict(tokens[i], values[i], chunk.input_token_ranks[i],
                                             chunk.input_top_logprobs[i]))
        return result

    # ------------------------------------------------------------------ caller side
    @property
    def finished(self) -> bool:
        return self._output.finished

    def done(self) -> bool:
        return self._output.finished

    def abort(self) -> None:
        """Cancel the request: it finishes with finish_reason 'cancelled' and its KV blocks are freed."""
        self._engine.abort_request(self.request_id, "cancelled")

    def _snapshot(self, last: dict[int, tuple[int, int]] | None = None) -> RequestOutput:
        snap = self._output.snapshot()
        if self._params.return_perf_metrics:
            snap.request_perf_metrics = self._metrics_copy()
            for co in snap.outputs:
                co.request_perf_metrics = snap.request_perf_metrics
        for co in snap.outputs:
            co._last_text_len, co._last_token_len = (last or {}).get(co.index, (0, 0))
        return snap

    def _metrics_copy(self) -> RequestPerfMetrics:
        return RequestPerfMetrics(**vars(self._metrics))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self._error}")

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the request to finish (TimeoutError after `timeout` seconds; the request goes on)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._output.finished, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            self._raise_if_failed()
            return self._snapshot()

    def __await__(self):
        return self._wait_async().__await__()

    async def _wait_async(self) -> RequestOutput:
        async for _ in self._updates_async():
            pass
        return self.result(timeout=0)

    def __iter__(self):
        last: dict[int, tuple[int, int]] = {}
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._version > seen or self._output.finished)
                seen = self._version
                finished = self._output.finished
                if not self.streaming and not finished:
                    continue
                self._raise_if_failed()
                snap = self._snapshot(last)
            last = {co.index: (len(co.text), len(co.token_ids)) for co in snap.outputs}
            yield snap
            if finished:
                return

    def output_chunks(self):
        """The engine's per-step OutputChunks of this request (every sequence), as they arrive, until it finished:
        the stream every other view (RequestOutput, executor Responses, server events) is built from."""
        sent = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._chunks) > sent or self._output.finished)
                new = self._chunks[sent:]
                finished = self._output.finished and len(self._chunks) == sent + len(new)
            sent += len(new)
            yield from new
            if finished:
                return

    async def _updates_async(self):
        """Yields each time new output arrived, until the request finished."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._async_waiters.append((loop, event))
        try:
            seen = -1
            while True:
                with self._cond:
                    version, finished = self._version, self._output.finished
                if version != seen:
                    seen = version
                    yield finished
                    if finished:
                        return
                await event.wait()
                event.clear()
        finally:
            with self._cond:
                self._async_waiters.remove((loop, event))

    async def __aiter__(self):
        last: dict[int, tuple[int, int]] = {}
        async for finished in self._updates_async():
            if not self.streaming and not finished:
                continue
            with self._cond:
                self._raise_if_failed()
                snap = self._snapshot(last)
            last = {co.index: (len(co.text), len(co.token_ids)) for co in snap.outputs}
            yield snap


class LLM:
    """Offline and async generation on one engine. ``LLM()`` runs the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **engine_options: Any):
        self.config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer, **engine_options)
        self._engine = LLMEngine(self.config)
        self._ids = itertools.count()
        self._kv_server = None     # a prefill role's KV transfer server (kv_transfer_role): serves pinned prompts
        if self.config.serves_kv:
            self._kv_server = self._start_kv_server()

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    # ------------------------------------------------------------------ prompts
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    @property
    def model_names(self) -> list[str]:
        """Names a request may use for the loaded model."""
        source = self._engine.source
        return list(dict.fromkeys(n for n in (source.name, os.path.basename(source.path),
                                              os.path.splitext(os.path.basename(source.path))[0]) if n))

    def generate_async(self, prompt: PromptType | TextGenerationRequest, sampling_params: SamplingParams | None = None,
                       streaming: bool = False, timeout: float | None = None,
                       cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                       disaggregated_params: DisaggregatedParams | None = None) -> RequestFuture:
        """Queue one request and return its future at once. `timeout` (seconds) ends it with finish_reason 'timeout'.
        `prompt` may be a TextGenerationRequest (its request_id, sampling_params and cache_salt are then used).
        `lora_request` runs it with that LoRA adapter (the engine needs enable_lora=True).
        `disaggregated_params` (an instance with a kv_transfer_role only): request_type "context_only" (role
        'prefill') prefills, samples one token and returns the DisaggregatedParams a "generation_only" request on
        another instance (role 'decode') needs; that one fetches the prompt's KV here, from one of its
        kv_transfer_peers, before it is queued. KVTransferBusy: no room to pin the prompt now."""
        return self._prepare(prompt, sampling_params, cache_salt, lora_request, disaggregated_params)(streaming, timeout)

    def _prepare(self, prompt, sampling_params: SamplingParams | None, cache_salt: str | None,
                 lora_request: LoRARequest | None = None, disaggregated_params: DisaggregatedParams | None = None):
        """Tokenize and check one prompt now; return submit(streaming, timeout) -> RequestFuture that queues it."""
        request_id = None
        if isinstance(prompt, TextGenerationRequest):
            if sampling_params is not None:
                raise ValueError("sampling_params: a TextGenerationRequest carries its own")
            request_id, cache_salt = prompt.request_id, prompt.cache_salt
            text, ids, params = prompt.resolve(self.tokenizer, self.model_names)
        else:
            params = sampling_params or SamplingParams()
            text, ids = self._tokenize(prompt)
        dp = disagg.coerce(disaggregated_params)
        if dp is not None and self.config.tensor_parallel_size > 1:
            raise ValueError(f"disaggregated_params is not supported with tensor_parallel_size="
                             f"{self.config.tensor_parallel_size} (the KV cache is split over ranks)")
        if dp is not None:
            disagg.check(dp, params, ids, self._engine, self.config)

        def submit(streaming: bool, timeout: float | None) -> RequestFuture:
            arrival = _now()
            options, kv_stats = disagg.request_options(dp, ids, self._engine.model_config, self.config)
            future = RequestFuture(next(self._ids) if request_id is None else request_id, text, ids, params,
                                   streaming, self._engine)
            future._metrics.arrival_time = arrival
            future._output.kv_transfer = kv_stats
            if lora_request is not None:
                options["lora_request"] = lora_request
            self._add(future, ids, params, timeout, cache_salt, options, dp)
            return future
        return submit

    def _add(self, future: RequestFuture, ids: list[int], params: SamplingParams, timeout: float | None,
             cache_salt: str | None, options: dict, dp: DisaggregatedParams | None) -> None:
        """Queue the future's request; a context-only one holds room for its pin until it finished
        (KVTransferBusy, queueing nothing, when the pinned prompts are at their cap)."""
        reservation = disagg.reserve_pin(dp, ids, self._engine.core.pinned, self.config)
        sink = future._on_chunk
        if reservation is not None:
            future._kv_endpoint = self.kv_transfer_endpoint
            sink = reservation.until_finished(sink)
        try:
            self._engine.add_request(future.request_id, ids, params, sink, timeout, cache_salt, **options)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise

    def generate(self, prompts: PromptType | TextGenerationRequest | Seq[PromptType | TextGenerationRequest],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, timeout: float | None = None,
                 cache_salt: str | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 disaggregated_params: DisaggregatedParams | Seq[DisaggregatedParams | None] | None = None,
                 ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt (returns one RequestOutput) or many (a list, in input order). Every prompt is
        tokenized and checked before any is queued; if queueing one fails, those already queued are aborted.
        lora_request: one LoRA adapter for every prompt, or a list with one entry (or None) per prompt; the same for
        disaggregated_params (see generate_async)."""
        single = isinstance(prompts, (str, dict, TextGenerationRequest)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts))
        batch = [prompts] if single else list(prompts)
        params_list = _per_prompt(sampling_params, "sampling_params", len(batch))
        loras = _per_prompt(lora_request, "lora_request", len(batch))
        disaggs = _per_prompt(disaggregated_params, "disaggregated_params", len(batch))
        submits = [self._prepare(p, params, cache_salt, lora, dp)
                   for p, params, lora, dp in zip(batch, params_list, loras, disaggs)]
        futures = []
        try:
            for submit in submits:
                futures.append(submit(False, timeout))
        except Exception:
            for f in futures:
                f.abort()
            raise
        results = self._wait_all(futures, use_tqdm and not single)
        return results[0] if single else results

    def _wait_all(self, futures: list[RequestFuture], progress: bool) -> list[RequestOutput]:
        if not progress:
            return [f.result() for f in futures]
        from tqdm.auto import tqdm
        results = []
        with tqdm(total=len(futures), desc="Processed prompts", unit="req") as bar:
            for f in futures:   # in input order; the bar advances as each one is collected
                results.append(f.result())
                bar.update(1)
        return results

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> RequestOutput | list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self.generate(prompts if len(prompts) > 1 else prompts[0], sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None) -> dict:
        return chat_prompt(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs)

    def get_latest_iteration_stats(self):
        return self._engine.core.last_stats

    def _start_kv_server(self):
        from petrel.disagg.kv_transfer import KVTransferServer
        try:
            return KVTransferServer(self._engine, self.config.kv_transfer_secret, self.config.kv_transfer_host,
                                    self.config.kv_transfer_port, self.config.kv_transfer_timeout)
        except BaseException:
            self._engine.shutdown()
            raise

    @property
    def kv_transfer_endpoint(self) -> str | None:
        """host:port of this instance's KV transfer server, which a prefill role (kv_transfer_role 'prefill' or
        'both') starts with the engine; None: this instance serves no KV."""
        return None if self._kv_server is None else self._kv_server.endpoint

    def shutdown(self) -> None:
        if self._kv_server is not None:
            self._kv_server.close()
        self._engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _now() -> float:
    return time.monotonic()


def _per_prompt(value, name: str, num_prompts: int) -> list:
    """One value for every prompt, or a list with one entry per prompt (ValueError naming `name` otherwise)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(f"{name} has {len(value)} entries for {num_prompts} prompts")
        return list(value)
    return [value] * num_prompts
