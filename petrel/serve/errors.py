"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} for every failure the server reports."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from petrel.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("petrel.serve")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in a handler; becomes an OpenAI error response with this status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump(mode="json")

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# the SamplingParams / engine fields a ValueError may name, and the request field each one is
_PARAM_NAMES = [
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "stop_token_ids",
    "stop",
    "n",
    "logprobs",
    "prompt_logprobs",
    "cache_salt",
    "dkv_cache_hint",
    "prompt_token_ids",
    "prompt",
]


def from_value_error(exc: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine (its message starts with, or names, the field)."""
    message = str(exc)
    words = message.replace(",", " ").replace(":", " ").split()
    param = next((w for w in words[:3] if w in _PARAM_NAMES), None)
    if param is None:
        param = next((p for p in _PARAM_NAMES if p in message), None)
    if param in ("prompt_token_ids", "prompt_logprobs"):
        param = {"prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}[param]
    if renames and param in renames:
        param = renames[param]
    return APIError(message, 400, param=param)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError("invalid request", 400)
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first.get('msg')}", 400, code="invalid_json")
    if not loc:
        if first.get("type") == "missing":
            return APIError("the request needs a JSON body", 400)
        return APIError(f"the request body must be a JSON object: {first.get('msg')}", 400)
    # a union reports one error per member: name the field, not pydantic's member tags
    param = ".".join(p for p in loc if not _is_union_tag(p)) or None
    if first.get("type") == "extra_forbidden":
        return APIError(
            f"Unrecognized request argument supplied: {param}", 400, param=param, code="unrecognized_argument"
        )
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return APIError(f"{param}: {first.get('msg')}{more}", 400, param=param)


def _body_parse_error(exc: StarletteHTTPException):
    """FastAPI answers a body json.loads fails on (other than a JSONDecodeError) with a bare 400 "There was an
    error parsing the body", keeping the cause: say what was wrong."""
    if exc.status_code != 400 or exc.detail != "There was an error parsing the body":
        return None
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        message = f"the request body is not valid JSON: it is not UTF-8 text ({cause.reason} at byte {cause.start})"
    elif isinstance(cause, RecursionError):
        message = "the request body is not valid JSON petrel accepts: its arrays / objects are nested too deeply"
    else:
        message = f"the request body is not valid JSON: {type(cause).__name__ if cause else 'unparseable'}"
    return APIError(message, 400, code="invalid_json").response()


def _unknown_route(request: Request, exc: StarletteHTTPException):
    """No route matched (FastAPI's bare "Not Found"): say which route, and that petrel does not serve it."""
    if exc.status_code != 404 or exc.detail != "Not Found":
        return None
    return APIError(
        f"{request.method} {request.url.path} is not a route petrel supports (see /docs for the routes it serves)",
        404,
        code="unsupported_route",
    ).response()


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "NamedToolChoice")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        response = (
            _body_parse_error(exc)
            or _unknown_route(request, exc)
            or APIError(str(exc.detail), exc.status_code).response()
        )
        response.headers.update(exc.headers or {})  # a 405's Allow, for one
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error serving %s", request.url.path)
        return APIError(f"internal error: {type(exc).__name__}: {exc}", 500).response()


ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (400, "invalid request: bad JSON, wrong types, unknown fields, values out of range, too long a prompt"),
        (401, "missing or wrong API key (when the server runs with --api-key)"),
        (404, "unknown model"),
        (413, "the request body is larger than the server accepts (--max-request-bytes)"),
        (
            429,
            "the server is full: more sequences in flight than --max-num-seqs + --max-queue-len, or disaggregated "
            "serving at its limits (pinned prompts, fetches at once); retry later",
        ),
        (500, "an error inside the engine"),
        (502, "disaggregated_params: fetching the prompt's KV from the context server failed"),
        (503, "the engine is shut down"),
    )
}
