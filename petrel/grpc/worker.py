"""What both gRPC worker services share over one LLM: the limits, the requests in flight (for Abort), health,
the tokenizer bundle, KV events, and running one request from its GenerateArgs to the builder's responses with
errors mapped to status codes."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc

from petrel.disagg.kv_transfer import KVTransferError
from petrel.disagg.params import KVTransferBusy
from petrel.grpc.kv_events import KvEventStream
from petrel.grpc.sampling import GenerateArgs, GenerateLimits
from petrel.grpc.tokenizer_bundle import bundle_bytes, bundle_chunks
from petrel.serve.disagg import fetch_pool


class WorkerBase:
    """`max_pending`: most sequences in flight (running + queued; None: no limit), past it RESOURCE_EXHAUSTED.
    `lora_modules`: served name -> LoRARequest; a request picks one by its lora_int_id."""

    def __init__(
        self,
        llm,
        served_model_name: str,
        max_pending: int | None = None,
        max_n: int = 16,
        chat_template: str | None = None,
        lora_modules: dict | None = None,
        health_timeout: float = 5.0,
    ):
        self.llm = llm
        self.model_name = served_model_name
        self.max_pending = max_pending
        self.chat_template = chat_template
        self.health_timeout = health_timeout
        self.limits = GenerateLimits(
            max_model_len=llm.engine.max_model_len,
            vocab_size=llm.engine.model_config.vocab_size,
            max_n=max_n,
            lora_by_id={lr.lora_int_id: lr for lr in (lora_modules or {}).values()},
        )
        self.in_flight: dict[str, object] = {}  # the client's request_id -> RequestFuture
        self.num_aborts = 0  # aborts that found their request
        self.kv_events = KvEventStream(llm)
        self._bundle: bytes | None = None

    async def health_error(self) -> str | None:
        """None when the engine answers in time, else why not."""
        try:
            await asyncio.to_thread(self.llm.engine.check_health, self.health_timeout)
        except Exception as exc:  # noqa: BLE001 - any failure to round-trip is unhealthy
            return f"the engine did not answer: {type(exc).__name__}: {exc}"
        return None

    async def tokenizer_chunks(self) -> list[tuple[bytes, str]]:
        if self._bundle is None:
            source = self.llm.engine.source
            model_dir = source.path if source.kind == "hf" else None  # a GGUF file keeps its config inside
            self._bundle = await asyncio.to_thread(bundle_bytes, self.llm.tokenizer, self.chat_template, model_dir)
        return bundle_chunks(self._bundle)

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight (its stream then ends); False when there is none by that id."""
        future = self.in_flight.get(request_id)
        if future is None:
            return False
        self.num_aborts += 1
        future.abort()
        return True

    async def _submit(self, request_id: str, make_args, context):
        try:
            args: GenerateArgs = make_args()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request_id in self.in_flight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is in flight")
        params = args.params
        num_new = params.beam_width if params.use_beam_search else params.n
        if self.max_pending is not None:
            pending = self.llm.engine.num_unfinished_sequences
            if pending + num_new > self.max_pending:
                self.llm.engine.events.rejected()  # /metrics: petrel_request_rejected_total, as HTTP's 429
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server is full ({pending} sequences in flight, this request adds {num_new}, "
                    f"limit {self.max_pending}); retry later",
                )

        def call():
            return self.llm.generate_async(args.prompt_token_ids, params, streaming=True, **args.options)

        dp = args.options.get("disaggregated_params")
        try:
            if dp is not None and dp.is_generation_only and self.llm.config.fetches_kv:
                return await fetch_pool(self.llm).run(call)  # the KV fetch runs off the event loop
            return call()
        except KVTransferBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"disaggregated_params: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (RuntimeError, ConnectionError, OSError) as exc:  # the engine is closed, or a KV fetch failed
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def run(self, request_id: str, make_args, builder, context):
        """The responses of one request: `make_args()` -> GenerateArgs (ValueError: INVALID_ARGUMENT), its
        OutputChunks through `builder.add`. Ends when every sequence finished or the request was aborted (an Abort,
        or the client cancelling the call)."""
        future = await self._submit(request_id, make_args, context)
        self.in_flight[request_id] = future
        try:
            sent = False
            async with aclosing(future.output_chunks_async(keep_history=False)) as chunks:
                async for chunk in chunks:
                    if chunk.error is not None:  # before any output (e.g. shutting down): another worker may retry
                        code = grpc.StatusCode.INTERNAL if sent else grpc.StatusCode.UNAVAILABLE
                        await context.abort(code, f"request failed: {chunk.error}")
                    for response in builder.add(chunk):
                        sent = True
                        yield response
        finally:
            self.in_flight.pop(request_id, None)
            if not future.done():
                future.abort()
