"""The FastAPI app: OpenAI-compatible routes over one LLM. `build_app(llm, ...)` is all a server needs."""

from __future__ import annotations

import asyncio
import os
import secrets

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles

import petrel
from petrel.model.tokenizer import longest_token_chars
from petrel.serve import worker_info
from petrel.serve.chat import create_chat_completion
from petrel.serve.chat_template import ChatTemplate, conversation_chars, messages_for_template
from petrel.serve.completions import create_completion
from petrel.serve.embeddings import add_embedding_routes
from petrel.serve.errors import ERROR_RESPONSES, APIError, install_error_handlers
from petrel.serve.limits import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit, HeapTrimmer
from petrel.serve.logprobs import TokenText
from petrel.serve.media import MediaLimits, image_parts
from petrel.serve.media_fetch import FetchOptions, MediaFetcher
from petrel.serve.metrics import ServerMetrics
from petrel.serve.params import ServerLimits, check_prompt_chars
from petrel.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ErrorResponse,
)
from petrel.serve.protocol_info import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from petrel.serve.responses import add_response_routes
from petrel.serve.responses_protocol import ResponseStreamEvent
from petrel.serve.streams import ServeState

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_QUEUE_LEN = 1024  # requests waiting beyond the running batch before new ones get 429

_bearer = HTTPBearer(auto_error=False, description="the server's --api-key, when it has one")
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")


def _add_stream_schemas(app: FastAPI, models) -> None:
    """The SSE event models appear only in text/event-stream content: put their schemas in the document."""
    make_default = app.openapi

    def openapi():
        if app.openapi_schema is None:
            doc = make_default()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
                for name, sub in schema.pop("$defs", {}).items():
                    schemas.setdefault(name, sub)
                schemas.setdefault(model.__name__, schema)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def _responses(model, stream_model=None) -> dict:
    ok = {"model": model, "description": "the result (application/json)"}
    if stream_model is not None:
        ok["description"] = (
            f"stream=false: the {model.__name__} (application/json). stream=true: server-sent "
            f"events (text/event-stream), each `data: <{stream_model.__name__} JSON>`, "
            "then `data: [DONE]`"
        )
        ok["content"] = {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{stream_model.__name__}"}}}
    return {200: ok, **ERROR_RESPONSES}


def _media_limits(llm, allow_remote: bool) -> MediaLimits:
    """What chat requests may carry as images and videos: none for a text-only model."""
    config = llm.config
    processor = getattr(llm.engine, "mm_processor", None)
    return MediaLimits(
        takes_images=processor is not None,
        takes_videos="video" in getattr(processor, "kinds", ()),
        max_images=(getattr(config, "limit_mm_per_prompt", None) or {}).get("image"),
        max_videos=(getattr(config, "limit_mm_per_prompt", None) or {}).get("video"),
        max_pixels=getattr(config, "max_image_pixels", MediaLimits.max_pixels),
        allow_remote=allow_remote,
    )


def _lora_requests(llm, base_name: str, lora_modules: dict[str, str]) -> dict:
    from petrel.lora import LoRARequest

    if lora_modules and not getattr(llm.config, "enable_lora", False):
        raise ValueError("lora_modules need an engine started with enable_lora=True (petrel serve --enable-lora)")
    loras = {}
    for i, (served, path) in enumerate(lora_modules.items(), start=1):
        if served == base_name:
            raise ValueError(f"LoRA module name {served!r} is the base model's served name")
        loras[served] = LoRARequest(served, i, path)
        llm.engine.core.lora_manager.register(loras[served])
    return loras


def build_app(
    llm,
    served_model_name: str | None = None,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_n: int = 16,
    health_timeout: float = 5.0,
    max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    lora_modules: dict[str, str] | None = None,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
    trust_special_tokens: bool = False,
    embedding_pooling: str = "last",
    allow_remote_media: bool = True,
    media_fetch: FetchOptions | None = None,
) -> FastAPI:
    """An app serving `llm` (a petrel.LLM). `chat_template` is Jinja source overriding the model's.
    lora_modules: served name -> PEFT LoRA adapter directory (the engine needs enable_lora); a request's `model`
    naming one runs with that adapter. Each adapter is read now: a bad one is a ValueError here.
    A body larger than max_request_bytes is a 413; one stalled body_timeout seconds between chunks a 408.
    At most max_num_seqs + max_queue_len sequences (n per request) are in flight (None: no limit); more get 429.
    trust_special_tokens: special-token strings in chat messages act as control tokens (only for trusted clients:
    by default they are text, so no message can forge another turn).
    embedding_pooling: how /v1/embeddings pools a prompt's final hidden states, 'last' (token) or 'mean'.
    allow_remote_media: fetch http(s) image URLs in chat messages (data: URLs are always taken).
    media_fetch: where and how long those fetches may go (default: public addresses only, 10 s per URL, 30 s per
    request, 4 requests fetching at once; see petrel/serve/media_fetch.py)."""
    name = served_model_name or getattr(llm.config, "model", None) or DEFAULT_MODEL_NAME
    core = llm.engine.core
    limits = ServerLimits(
        max_model_len=llm.engine.max_model_len,
        vocab_size=core.model_config.vocab_size,
        max_n=max_n,
        max_prompt_chars=llm.engine.max_model_len * longest_token_chars(llm.tokenizer),
    )
    loras = _lora_requests(llm, name, lora_modules or {})
    state = ServeState(
        llm=llm,
        model_name=name,
        limits=limits,
        lora_modules=loras,
        template=ChatTemplate(llm.tokenizer, chat_template, trust_special_tokens),
        metrics=ServerMetrics(name),
        token_text=TokenText(llm.tokenizer),
        api_key=api_key,
        health_timeout=health_timeout,
        max_pending=None if max_queue_len is None else llm.config.max_num_seqs + max_queue_len,
        media=_media_limits(llm, allow_remote_media),
        media_fetcher=MediaFetcher(media_fetch),
        trimmer=HeapTrimmer(),
    )
    llm.engine.events.listen(state.metrics)  # every request on this engine, whatever its front, counts on /metrics

    async def check_key(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if state.api_key is None:
            return
        if creds is None or not secrets.compare_digest(creds.credentials.encode(), state.api_key.encode()):
            raise APIError(
                "Incorrect or missing API key: send `Authorization: Bearer <key>`", 401, code="invalid_api_key"
            )

    app = FastAPI(
        title="petrel",
        version=petrel.__version__,
        description="An OpenAI-compatible server for the petrel inference engine.",
    )
    app.state.petrel = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes, body_timeout=body_timeout, trimmer=state.trimmer)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])
    extra = APIRouter(dependencies=[Depends(check_key)])

    @v1.post(
        "/completions",
        response_model=None,
        responses=_responses(CompletionResponse, CompletionStreamResponse),
        summary="Create a completion (OpenAI legacy completions)",
    )
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(state, body, request)

    @v1.post(
        "/chat/completions",
        response_model=None,
        responses=_responses(ChatCompletionResponse, ChatCompletionChunk),
        summary="Create a chat completion",
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(state, body, request)

    def model_cards() -> list[ModelCard]:
        base = ModelCard(
            id=name, created=state.created, root=getattr(llm.config, "model", None), max_model_len=limits.max_model_len
        )
        return [base] + [
            ModelCard(id=n, created=state.created, root=lr.lora_path, parent=name, max_model_len=limits.max_model_len)
            for n, lr in loras.items()
        ]

    add_response_routes(v1, state)  # POST /v1/responses, GET /v1/responses/{response_id}
    add_embedding_routes(v1, state, embedding_pooling)  # POST /v1/embeddings

    @v1.get("/models", response_model=ModelList, responses=ERROR_RESPONSES, summary="The served model")
    async def models() -> ModelList:
        return ModelList(data=model_cards())

    @v1.get(
        "/models/{model:path}",
        response_model=ModelCard,
        responses=ERROR_RESPONSES,
        summary="One served model (the base model or a LoRA adapter) by its id",
    )
    async def retrieve_model(model: str) -> ModelCard:
        state.check_model(model)  # 404 naming the served models
        return next(card for card in model_cards() if card.id == model)

    @extra.post(
        "/tokenize",
        response_model=TokenizeResponse,
        responses=ERROR_RESPONSES,
        summary="Token ids of a prompt, or of messages through the chat template",
    )
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, param="prompt")
        if body.prompt is not None:
            check_prompt_chars(len(body.prompt), limits, "prompt")
            ids = (
                await state.run_blocking(lambda: llm.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens))
            )["input_ids"]
        else:
            parts = image_parts(body.messages) + image_parts(body.messages, "video_url")
            if parts and state.media.takes_images:
                raise APIError(
                    "/tokenize counts text: an image's or video's tokens depend on it, send it to /v1/chat/completions",
                    400,
                    param=parts[0][0],
                )
            messages = messages_for_template(
                body.messages, state.template.supports_tools, state.media.takes_images, state.media.takes_videos
            )
            check_prompt_chars(conversation_chars(messages), limits, "messages")
            ids = await state.run_blocking(
                lambda: state.template.encode(messages, add_generation_prompt=body.add_generation_prompt)
            )
        return TokenizeResponse(count=len(ids), max_model_len=limits.max_model_len, tokens=ids)

    @extra.post(
        "/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES, summary="The text of token ids"
    )
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < limits.vocab_size]
        if bad:
            raise APIError(f"tokens outside the vocabulary (size {limits.vocab_size}): {bad[:5]}", 400, param="tokens")
        return DetokenizeResponse(prompt=await state.run_blocking(llm.tokenizer.decode, body.tokens))

    async def engine_load() -> dict:
        try:
            return await asyncio.to_thread(llm.engine.call, worker_info.engine_load, state.health_timeout)
        except Exception as exc:  # noqa: BLE001 - a stuck engine has no load to report
            raise APIError(f"the engine did not answer: {type(exc).__name__}: {exc}", 503) from None

    @v1.get("/loads", summary="The engine's load (running / waiting sequences, KV-cache use), as gateways read it")
    async def loads() -> dict:
        return worker_info.loads_response(await engine_load(), llm.config.max_num_seqs)

    for path in ("/server_info", "/get_server_info"):
        extra.add_api_route(
            path,
            lambda: worker_info.server_info(llm, name),
            methods=["GET"],
            summary="The server: version, backend, parallelism, limits (a gateway's worker labels)",
        )
    for path in ("/model_info", "/get_model_info"):
        extra.add_api_route(
            path,
            lambda: worker_info.model_info(llm, name),
            methods=["GET"],
            summary="The served model: name, path, context length, sizes (a gateway's worker labels)",
        )

    @app.get(
        "/health",
        response_model=HealthResponse,
        summary="200 when the engine loop is in a step (not stalled) or answers in time",
        responses={503: {"model": ErrorResponse, "description": "the engine loop is stuck or gone"}},
    )
    async def health():
        try:
            await asyncio.to_thread(llm.engine.check_health, state.health_timeout)
        except Exception as exc:  # noqa: BLE001 - any failure to round-trip is unhealthy
            return APIError(f"the engine did not answer: {type(exc).__name__}: {exc}", 503).response()
        return JSONResponse(HealthResponse().model_dump())

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=Response,
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "Prometheus text exposition format",
            }
        },
    )
    async def metrics():
        data = await state.metrics.render(llm.engine)
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    # the chat page: public (its own API calls carry the key), plain files, not part of the API schema
    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"), media_type="text/html; charset=utf-8")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.include_router(v1)
    app.include_router(extra)
    _add_stream_schemas(app, [CompletionStreamResponse, ChatCompletionChunk, ResponseStreamEvent])
    return app
