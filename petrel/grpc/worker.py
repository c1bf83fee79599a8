"""What both gRPC worker services share over one LLM: the limits, the requests in flight (for Abort), health,
the tokenizer bundle, KV events, and running one request from its GenerateArgs to the builder's responses with
errors mapped to status codes.

A request is checked against the limits first (constant time, on the event loop); one whose preparation grows
with its size is then prepared on the PreparePool, the rest on the loop; a guided-decoding constraint compiles on
the grammar compiler's workers, awaited. So the loop only ever does a few milliseconds of work per request."""

from __future__ import annotations

import asyncio
import functools
from contextlib import aclosing

import grpc

from petrel.disagg.kv_transfer import KVTransferError
from petrel.disagg.params import KVTransferBusy
from petrel.engine.grammar import GrammarCompilerBusy
from petrel.grpc.kv_events import KvEventStream
from petrel.grpc.prepare_pool import PreparePool, run_inline
from petrel.grpc.sampling import GenerateArgs, GenerateLimits
from petrel.grpc.tokenizer_bundle import bundle_bytes, bundle_chunks
from petrel.serve.disagg import fetch_pool


class Preparing:
    """In `in_flight` while a request is prepared: an Abort then is applied once it is queued."""

    aborted = False

    def abort(self) -> None:
        self.aborted = True


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
        self.in_flight: dict[str, object] = {}  # the client's request_id -> RequestFuture (or Preparing)
        self.num_aborts = 0  # aborts that found their request
        self.kv_events = KvEventStream(llm)
        self.prepare_pool = PreparePool()
        self._preparing: set[asyncio.Task] = set()  # the calls whose request is being prepared
        self._closing = False
        self._bundle: bytes | None = None

    def close(self) -> None:
        """(On the event loop.) The server is stopping: calls whose request is still being prepared end at once
        with UNAVAILABLE (another worker may take them), rather than holding the server's grace period."""
        self._closing = True
        for task in self._preparing:
            task.cancel()
        self.prepare_pool.close()

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

    async def check_sizes(self, check, request, context) -> None:
        """check(request, limits) (the lengths of its lists) on the event loop: INVALID_ARGUMENT at once."""
        try:
            check(request, self.limits)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _submit(self, make_args, context, slow: bool):
        """The request's RequestFuture: prepared (make_args, then generate_async) on the PreparePool when `slow`,
        else on the event loop; failures abort the call with their status."""
        prepare = self.prepare_pool.run if slow else run_inline
        try:
            args: GenerateArgs = await prepare(make_args)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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

        call = functools.partial(self.llm.generate_async, args.prompt_token_ids, params, streaming=True, **args.options)
        dp = args.options.get("disaggregated_params")
        try:
            compiled = await self._compile(params, prepare)  # noqa: F841 - held until queued: the engine finds it
            if dp is not None and dp.is_generation_only and self.llm.config.fetches_kv:
                return await fetch_pool(self.llm).run(call)  # the KV fetch runs off the event loop
            return await prepare(call, on_orphan=lambda future: future.abort())
        except GrammarCompilerBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except KVTransferBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"disaggregated_params: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (RuntimeError, ConnectionError, OSError) as exc:  # the engine is closed, or a KV fetch failed
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def _prepared(self, make_args, context, slow: bool):
        """_submit, ended early (UNAVAILABLE) when the server stops meanwhile."""
        task = asyncio.current_task()
        self._preparing.add(task)
        try:
            return await self._submit(make_args, context, slow)
        except asyncio.CancelledError:
            if not self._closing:
                raise
        finally:
            self._preparing.discard(task)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    async def _compile(self, params, prepare):
        """The request's guided-decoding constraint compiled on the grammar compiler's workers (None without one):
        a compile never holds the event loop or a preparing thread. Its size checks (a scan of the constraint)
        run where the request is prepared."""
        if params.guided_decoding is None:
            return None
        compiler = self.llm.engine.grammar_compiler
        future = await prepare(functools.partial(compiler.submit, params.guided_decoding))
        return await asyncio.wrap_future(future)

    async def run(self, request_id: str, make_args, builder, context, slow: bool = False):
        """The responses of one request: `make_args()` -> GenerateArgs (ValueError: INVALID_ARGUMENT), its
        OutputChunks through `builder.add`. Ends when every sequence finished or the request was aborted (an Abort,
        or the client cancelling the call). `slow`: prepared on the PreparePool."""
        if request_id in self.in_flight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is in flight")
        preparing = self.in_flight[request_id] = Preparing()
        future = None
        try:
            future = await self._prepared(make_args, context, slow)
            self.in_flight[request_id] = future
            if preparing.aborted:
                future.abort()
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
            if future is not None and not future.done():
                future.abort()
