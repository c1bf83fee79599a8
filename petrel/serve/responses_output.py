"""What a response is made of: the output items and usage built from a chat answer, the response object
(Turn), and the bounded in-memory store that previous_response_id and GET /v1/responses/{id} read."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from petrel.serve.errors import APIError
from petrel.serve.responses_input import input_messages
from petrel.serve.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from petrel.serve.streams import new_id

RESPONSE_STORE_SIZE = 1024  # responses kept for previous_response_id / GET (least recently used dropped first)


@dataclass
class Stored:
    response: dict  # the response object, as returned
    messages: list[dict]  # its conversation as chat messages (without instructions), output included


class ResponseStore:
    """A bounded LRU of responses by id (thread-safe: handlers run on the event loop, tests may poke it)."""

    def __init__(self, size: int = RESPONSE_STORE_SIZE):
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, response_id: str) -> Stored:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
        if stored is None:
            raise APIError(
                f"Response with id '{response_id}' not found (petrel keeps the {self.size} most recent stored "
                "responses, in memory)",
                404,
                param="previous_response_id",
                code="response_not_found",
            )
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def new_item_id(prefix: str) -> str:
    return new_id(prefix).replace("-", "_")


@dataclass
class Turn:
    """One response being built: the request, its history, and what its output becomes."""

    req: ResponsesRequest
    history: list[dict]
    model: str
    id: str = ""
    created_at: int = 0

    def __post_init__(self):
        self.id = self.id or new_item_id("resp")

    def response(self, output: list, usage: ResponseUsage | None, status: str) -> ResponseObject:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else {"type": "text"}
        body = ResponseObject(
            id=self.id,
            status=status,
            model=self.model,
            output=output,
            instructions=req.instructions,
            tools=req.tools or [],
            tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id,
            text={"format": fmt},
            metadata=req.metadata or {},
            store=req.store,
            usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        )
        if self.created_at:
            body.created_at = self.created_at
        self.created_at = body.created_at
        return body

    def remember(self, store: ResponseStore, body: ResponseObject) -> None:
        if not self.req.store:
            return
        messages = self.history + input_messages(self.req.input) + output_messages(body.output)
        store.put(body.id, Stored(body.model_dump(mode="json"), messages))


def output_messages(output: list) -> list[dict]:
    """A response's output items as the chat messages a continuation shows the model."""
    content = "".join(p.text for item in output if isinstance(item, OutputMessage) for p in item.content)
    calls = [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in output
        if isinstance(c, FunctionCallItem)
    ]
    message: dict = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def usage_of(usage: dict | None) -> ResponseUsage | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ResponseUsage(
        input_tokens=usage["prompt_tokens"],
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
    )


def output_items(message: dict) -> list:
    """A chat choice's message -> output items: the reasoning (if any), the text (if any, or if there is no call) then
    the calls."""
    items: list = []
    if message.get("reasoning_content"):
        items.append(ReasoningItem(id=new_item_id("rs"), content=[ReasoningText(text=message["reasoning_content"])]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(OutputMessage(id=new_item_id("msg"), content=[OutputText(text=message.get("content") or "")]))
    for call in calls:
        fn = call["function"]
        items.append(
            FunctionCallItem(id=new_item_id("fc"), call_id=call["id"], name=fn["name"], arguments=fn["arguments"])
        )
    return items
