"""The gRPC worker's API key: every call carries metadata `authorization: Bearer <key>` (the header HTTP takes, and
the way smg's HTTP router passes a worker's key), compared in constant time, or is refused UNAUTHENTICATED before
its request is even parsed. HealthCheck stays open, as HTTP's /health is: it tells only whether the engine answers,
and probes (the gateway's, Kubernetes') carry no credentials."""

from __future__ import annotations

import secrets

import grpc

OPEN_METHODS = frozenset({"HealthCheck"})  # the method names, in either service, that need no key
MESSAGE = "Incorrect or missing API key: send metadata `authorization: Bearer <key>`"


def bearer_token(metadata) -> str | None:
    """The credentials of the first `authorization` entry, when its scheme is Bearer (any case)."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            scheme, _, credentials = (value if isinstance(value, str) else "").partition(" ")
            return credentials if scheme.lower() == "bearer" else None
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        self._key = api_key.encode()

    def authorized(self, metadata) -> bool:
        token = bearer_token(metadata)
        return token is not None and secrets.compare_digest(token.encode(), self._key)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler is None or method in OPEN_METHODS or self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusal(handler)


async def _refuse(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGE)


def _refusal(handler):
    """A handler of the same kind that answers UNAUTHENTICATED without parsing the request."""
    ignore = lambda data: None  # noqa: E731 - the request's bytes, never parsed
    if handler.unary_unary:
        make = grpc.unary_unary_rpc_method_handler
    elif handler.unary_stream:
        make = grpc.unary_stream_rpc_method_handler
    elif handler.stream_unary:
        make = grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.stream_stream_rpc_method_handler
    return make(_refuse, request_deserializer=ignore, response_serializer=handler.response_serializer)
