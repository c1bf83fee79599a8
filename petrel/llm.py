"""The LLM API: generate, generate_async (a RequestFuture you can wait on, await, or iterate), chat."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any

from petrel.config import EngineConfig
from petrel.disagg import DisaggregatedParams
from petrel.disagg import requests as disagg
from petrel.engine.kv_retention import make_retention
from petrel.engine.llm_engine import LLMEngine
from petrel.heap import freeze_startup_objects, thaw_frozen_objects
from petrel.kv_tiers.dkv_hint import parse_dkv_cache_hint
from petrel.lora import LoRARequest
from petrel.model.tokenizer import chat_prompt
from petrel.multimodal.prompts import multi_modal_prompt, processed_prompt
from petrel.outputs import RequestOutput
from petrel.request_future import RequestFuture, cached_token_decoder
from petrel.sampling_params import SamplingParams
from petrel.text_request import TextGenerationRequest

__all__ = ["LLM", "RequestFuture"]

logger = logging.getLogger("petrel")

PromptType = str | list[int]


class LLM:
    """Offline and async generation on one engine. ``LLM()`` runs the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **engine_options: Any):
        self.config = EngineConfig.from_kwargs(model=model, tokenizer=tokenizer, **engine_options)
        self._engine = LLMEngine(self.config)
        self._decode_token = cached_token_decoder(self._engine.tokenizer)  # logprob text, shared by requests
        self._ids = itertools.count()
        self._kv_server = None  # a prefill role's KV transfer server (kv_transfer_role): serves pinned prompts
        if self.config.serves_kv:
            self._kv_server = self._start_kv_server()
        freeze_startup_objects()

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    # ------------------------------------------------------------------ prompts
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            raise ValueError("multi_modal_data is taken by generate and generate_async")
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
        return list(
            dict.fromkeys(
                n
                for n in (
                    source.name,
                    os.path.basename(source.path),
                    os.path.splitext(os.path.basename(source.path))[0],
                )
                if n
            )
        )

    def generate_async(
        self,
        prompt: PromptType | TextGenerationRequest,
        sampling_params: SamplingParams | None = None,
        streaming: bool = False,
        timeout: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        disaggregated_params: DisaggregatedParams | None = None,
        dkv_cache_hint: dict | None = None,
        kv_cache_retention_config=None,
    ) -> RequestFuture:
        """Queue one request and return its future at once. `timeout` (seconds) ends it with finish_reason 'timeout'.
        `prompt` may be a TextGenerationRequest (its request_id, sampling_params and cache_salt are then used).
        `lora_request` runs it with that LoRA adapter (the engine needs enable_lora=True).
        `disaggregated_params` (an instance with a kv_transfer_role only): request_type "context_only" (role
        'prefill') prefills, samples one token and returns the DisaggregatedParams a "generation_only" request on
        another instance (role 'decode') needs; that one fetches the prompt's KV here, from one of its
        kv_transfer_peers, before it is queued. KVTransferBusy: no room to pin the prompt now.
        Streaming beam search: an update after each step with the best n running beams, each whole (beams reorder
        and fork, so an output's tokens may change from one update to the next); the last update is the final beams.
        `dkv_cache_hint` ({"block_hashes": [hex, ...]} and/or {"num_cached_tokens": N}): blocks the shared KV store
        holds (petrel/kv_tiers/dkv_hint.py); a TextGenerationRequest's own hint is used when it has one.
        `kv_cache_retention_config` (TensorRT-LLM's KvCacheRetentionConfig, an object or a dict of its fields): the
        eviction priorities of the request's cached KV blocks (petrel/engine/kv_retention.py)."""
        return self._prepare(
            prompt,
            sampling_params,
            cache_salt,
            lora_request,
            disaggregated_params,
            dkv_cache_hint,
            kv_cache_retention_config,
        )(streaming, timeout)

    def _prepare(
        self,
        prompt,
        sampling_params: SamplingParams | None,
        cache_salt: str | None,
        lora_request: LoRARequest | None = None,
        disaggregated_params: DisaggregatedParams | None = None,
        dkv_cache_hint: dict | None = None,
        kv_cache_retention_config=None,
    ):
        """Tokenize and check one prompt now; return submit(streaming, timeout) -> RequestFuture that queues it."""
        request_id, multi_modal = None, None
        request = prompt if isinstance(prompt, TextGenerationRequest) else None
        if request is not None:
            if sampling_params is not None:
                raise ValueError("sampling_params: a TextGenerationRequest carries its own")
            request_id, cache_salt = prompt.request_id, prompt.cache_salt
            if prompt.dkv_cache_hint is not None:
                dkv_cache_hint = prompt.dkv_cache_hint
            processor = self._engine.mm_processor
            takes_videos = "video" in getattr(processor, "kinds", ())
            text, ids, params = prompt.resolve(self.tokenizer, self.model_names, processor is not None, takes_videos)
            if processor is not None:
                ids, multi_modal = prompt.multi_modal_inputs(
                    processor, ids, self.config.limit_mm_per_prompt, self.config.max_image_pixels
                )
        else:
            params = sampling_params or SamplingParams()
            if isinstance(prompt, dict) and "multi_modal_inputs" in prompt:  # processed already (petrel serve)
                text, ids, multi_modal = processed_prompt(prompt)
            elif isinstance(prompt, dict) and "multi_modal_data" in prompt:
                text, ids, multi_modal = multi_modal_prompt(
                    self._engine.mm_processor, prompt, self.config.limit_mm_per_prompt, self.config.max_image_pixels
                )
            else:
                text, ids = self._tokenize(prompt)
                if self._engine.mm_processor is not None:  # an image placeholder without its image is refused
                    self._engine.mm_processor.process(ids, [])
        dp = disagg.coerce(disaggregated_params)
        if dp is not None and self.config.tensor_parallel_size > 1:
            raise ValueError(
                f"disaggregated_params is not supported with tensor_parallel_size="
                f"{self.config.tensor_parallel_size} (the KV cache is split over ranks)"
            )
        if dp is not None:
            disagg.check(dp, params, ids, self._engine, self.config)
        hint = parse_dkv_cache_hint(dkv_cache_hint)
        retention = None if kv_cache_retention_config is None else make_retention(kv_cache_retention_config)

        def submit(streaming: bool, timeout: float | None) -> RequestFuture:
            arrival = _now() if request is None else _arrival(request.timestamp_ns)
            options, kv_stats = disagg.request_options(
                dp, ids, self._engine.model_config, self.config, self._engine.events
            )
            future = RequestFuture(
                next(self._ids) if request_id is None else request_id,
                text,
                ids,
                params,
                streaming,
                self._engine,
                self._decode_token,
                arrival,
            )
            future._builder.kv_transfer = kv_stats
            if request is not None:
                _apply_request_options(future, request, text, ids, self.tokenizer)
            if lora_request is not None:
                options["lora_request"] = lora_request
            if multi_modal is not None:
                options["multi_modal"] = multi_modal
            if hint is not None:
                options["kv_hint_keys"], options["kv_hint_tokens"] = hint.block_keys, hint.num_cached_tokens
            if retention is not None:
                options["kv_retention"] = retention
            if streaming and params.use_beam_search:  # each step's best beams, whole
                options["stream_beams"] = True
            self._add(future, ids, params, timeout, cache_salt, options, dp)
            return future

        return submit

    def _add(
        self,
        future: RequestFuture,
        ids: list[int],
        params: SamplingParams,
        timeout: float | None,
        cache_salt: str | None,
        options: dict,
        dp: DisaggregatedParams | None,
    ) -> None:
        """Queue the future's request; a context-only one holds room for its pin until it finished
        (KVTransferBusy, queueing nothing, when the pinned prompts are at their cap)."""
        reservation = disagg.reserve_pin(dp, ids, self._engine.core.pinned, self.config)
        sink = future._on_output
        if reservation is not None:
            future._builder.kv_endpoint = self.kv_transfer_endpoint
            sink = reservation.until_finished(sink)
        try:
            future._route = self._engine.add_request(
                future.request_id, ids, params, sink, timeout, cache_salt, **options
            )
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise

    def generate(
        self,
        prompts: PromptType | TextGenerationRequest | Seq[PromptType | TextGenerationRequest],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        timeout: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        disaggregated_params: DisaggregatedParams | Seq[DisaggregatedParams | None] | None = None,
        dkv_cache_hint: dict | Seq[dict | None] | None = None,
        kv_cache_retention_config=None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt (returns one RequestOutput) or many (a list, in input order). Every prompt is
        tokenized and checked before any is queued; if queueing one fails, those already queued are aborted.
        lora_request: one LoRA adapter for every prompt, or a list with one entry (or None) per prompt; the same for
        disaggregated_params, dkv_cache_hint and kv_cache_retention_config (see generate_async)."""
        single = isinstance(prompts, (str, dict, TextGenerationRequest)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        )
        batch = [prompts] if single else list(prompts)
        params_list = _per_prompt(sampling_params, "sampling_params", len(batch))
        loras = _per_prompt(lora_request, "lora_request", len(batch))
        disaggs = _per_prompt(disaggregated_params, "disaggregated_params", len(batch))
        hints = _per_prompt(dkv_cache_hint, "dkv_cache_hint", len(batch))
        retentions = _per_prompt(kv_cache_retention_config, "kv_cache_retention_config", len(batch))
        submits = [
            self._prepare(p, params, cache_salt, lora, dp, hint, retention)
            for p, params, lora, dp, hint, retention in zip(batch, params_list, loras, disaggs, hints, retentions)
        ]
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
        """Wait for every future, processing each one's output as it arrives (so a stop string in any of them
        reaches the engine at once, not when the ones before it in the list are done)."""
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(futures), desc="Processed prompts", unit="req")
        arrived = threading.Event()
        for f in futures:
            f._outputs.signal = arrived
            # without stop strings nothing needs finding between steps: wake when a sequence ends, so this thread
            # does not compete with the engine's threads every step (the rest is processed at the end)
            f._outputs.signal_final_only = not f._processor.has_stop_strings
        try:
            waiting = list(futures)
            while waiting:
                arrived.clear()
                still = [f for f in waiting if not f.finished]
                if bar is not None and len(still) < len(waiting):
                    bar.update(len(waiting) - len(still))
                waiting = still
                if waiting:
                    arrived.wait()
        finally:
            for f in futures:
                f._outputs.signal = None
            if bar is not None:
                bar.close()
        return [f.result() for f in futures]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self.generate(prompts if len(prompts) > 1 else prompts[0], sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None
    ) -> dict:
        return chat_prompt(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs)

    def get_latest_iteration_stats(self):
        return self._engine.core.last_stats

    def _start_kv_server(self):
        from petrel.disagg.kv_transfer import KVTransferServer

        try:
            return KVTransferServer(
                self._engine,
                self.config.kv_transfer_secret,
                self.config.kv_transfer_host,
                self.config.kv_transfer_port,
                self.config.kv_transfer_timeout,
            )
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
        thaw_frozen_objects()  # this engine's cycles (the model's tensors among them) collectable again

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _now() -> float:
    return time.monotonic()


def _arrival(timestamp_ns: int) -> float:
    """The monotonic arrival time: now, or when the request was received (wall-clock timestamp_ns > 0), so queue
    time counts from then (a timestamp in the future counts as now)."""
    now = _now()
    if timestamp_ns <= 0:
        return now
    return now - max(0, time.time_ns() - timestamp_ns) / 1e9


def _apply_request_options(future: RequestFuture, request: TextGenerationRequest, text, ids, tokenizer) -> None:
    """A TextGenerationRequest's output options on its future: echo, tool-call parsing, request_path."""
    builder = future._builder
    path = request.normalized_request_path
    builder.metrics.request_path = path
    if request.echo:
        builder.echo(text if text is not None else tokenizer.decode(ids))
    builder.parse_tools = request.tools is not None
    logger.info("request %r: path=%s prompt_tokens=%d", future.request_id, path, len(ids))


def _per_prompt(value, name: str, num_prompts: int) -> list:
    """One value for every prompt, or a list with one entry per prompt (ValueError naming `name` otherwise)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(f"{name} has {len(value)} entries for {num_prompts} prompts")
        return list(value)
    return [value] * num_prompts
