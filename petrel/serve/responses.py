"""POST /v1/responses and GET /v1/responses/{id}: the OpenAI Responses API over the chat path.

A request is translated (responses_input) into a Chat Completions request and run by chat.create_chat_completion,
so the chat template, tool prompt, forced-call grammar and tool parser are the chat endpoint's own; its answer
(or its stream, responses_stream) is translated back into output items: a `message` with `output_text`, and one
`function_call` item per tool call.

previous_response_id continues a stored response: its conversation (input messages and output, without its
instructions, as OpenAI does) comes before the new input. The store is in memory and bounded: the
RESPONSE_STORE_SIZE most recent responses (least recently used dropped first); `store: false` keeps nothing.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from petrel.serve.chat import create_chat_completion
from petrel.serve.errors import ERROR_RESPONSES, APIError
from petrel.serve.responses_input import chat_request, check_refused, rename_error
from petrel.serve.responses_output import RESPONSE_STORE_SIZE, ResponseStore, Turn, output_items, usage_of
from petrel.serve.responses_protocol import ResponseObject, ResponsesRequest
from petrel.serve.responses_stream import stream_events
from petrel.serve.streams import ServeState


async def create_response(state: ServeState, store: ResponseStore, req: ResponsesRequest, request: Request):
    check_refused(req)
    history = store.get(req.previous_response_id).messages if req.previous_response_id else []
    turn = Turn(req, history, state.response_model(req.model))
    chat_req = chat_request(req, history, req.stream)
    try:
        answer = await create_chat_completion(state, chat_req, request)
    except APIError as exc:
        raise rename_error(exc) from None
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(stream_events(turn, store, answer.body_iterator), media_type="text/event-stream")
    if not isinstance(answer, JSONResponse):  # the client went away (499)
        return answer
    chat = json.loads(answer.body)
    choice = chat["choices"][0]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    body = turn.response(output_items(choice["message"]), usage_of(chat["usage"]), status)
    turn.remember(store, body)
    return JSONResponse(body.model_dump(mode="json"))


def add_response_routes(router: APIRouter, state: ServeState, store_size: int = RESPONSE_STORE_SIZE) -> ResponseStore:
    """POST /responses and GET /responses/{response_id} on `router` (the app's /v1 router)."""
    store = ResponseStore(store_size)
    ok = {
        "model": ResponseObject,
        "description": "stream=false: the ResponseObject (application/json). stream=true: server-sent events "
        "(text/event-stream), each `event: <type>` and `data: <ResponseStreamEvent JSON>`, ending with "
        "response.completed (or response.incomplete / response.failed)",
        "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/ResponseStreamEvent"}}},
    }

    @router.post(
        "/responses", response_model=None, responses={200: ok, **ERROR_RESPONSES}, summary="Create a model response"
    )
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(state, store, body, request)

    @router.get(
        "/responses/{response_id}",
        response_model=None,
        responses={200: {"model": ResponseObject}, **ERROR_RESPONSES},
        summary="A stored response",
    )
    async def get_response(response_id: str) -> Response:
        try:
            return JSONResponse(store.get(response_id).response)
        except APIError as exc:
            raise APIError(exc.message, 404, param="response_id", code=exc.code) from None

    return store
