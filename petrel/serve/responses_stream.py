"""A streamed response: the chat path's SSE chunks -> the Responses API's events, in OpenAI's names and order.

  response.created, response.in_progress
  per output item, in order: response.output_item.added, then
    reasoning:        response.reasoning_text.delta ..., response.reasoning_text.done
    a message:        response.content_part.added, response.output_text.delta ..., response.output_text.done,
                      response.content_part.done
    a function call:  response.function_call_arguments.delta ..., response.function_call_arguments.done
  and response.output_item.done
  response.completed (response.incomplete when max_output_tokens cut it short; response.failed on an engine error)
Each event is `event: <type>` + `data: <JSON with type and sequence_number>`; the last one carries the whole
response, equal to what stream=false returns.
"""

from __future__ import annotations

import json
from contextlib import aclosing

from petrel.serve.responses_output import ResponseStore, Turn, new_item_id, usage_of
from petrel.serve.responses_protocol import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
)


class _Events:
    def __init__(self):
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number}
        for key, value in fields.items():
            data[key] = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Output:
    """The output items as they grow; `open` is the item still receiving deltas (the last one)."""

    def __init__(self, event: _Events):
        self.event = event
        self.items: list = []
        self.open = None
        self.calls: dict[int, FunctionCallItem] = {}  # the chat stream's tool-call index -> its item

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def close(self):
        item, self.open = self.open, None
        if item is None:
            return
        item.status = "completed"
        ev, at = self.event, {"item_id": item.id, "output_index": self.items.index(item)}
        if isinstance(item, OutputMessage):
            part = item.content[0]
            yield ev("response.output_text.done", **at, content_index=0, text=part.text, logprobs=[])
            yield ev("response.content_part.done", **at, content_index=0, part=part)
        elif isinstance(item, ReasoningItem):
            yield ev("response.reasoning_text.done", **at, content_index=0, text=item.content[0].text)
        else:
            yield ev("response.function_call_arguments.done", **at, name=item.name, arguments=item.arguments)
        yield ev("response.output_item.done", output_index=at["output_index"], item=item)

    def reasoning(self, delta: str):
        if not isinstance(self.open, ReasoningItem):
            yield from self.close()
            item = ReasoningItem(id=new_item_id("rs"), status="in_progress", content=[ReasoningText(text="")])
            self.items.append(item)
            self.open = item
            yield self.event("response.output_item.added", output_index=self.index, item=item)
        self.open.content[0].text += delta
        yield self.event(
            "response.reasoning_text.delta", item_id=self.open.id, output_index=self.index, content_index=0, delta=delta
        )

    def text(self, delta: str):
        if not isinstance(self.open, OutputMessage):
            yield from self.close()
            item = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
            self.items.append(item)
            self.open = item
            yield self.event("response.output_item.added", output_index=self.index, item=item)
            item.content.append(OutputText(text=""))
            yield self.event(
                "response.content_part.added",
                item_id=item.id,
                output_index=self.index,
                content_index=0,
                part=item.content[0],
            )
        if delta:
            self.open.content[0].text += delta
            yield self.event(
                "response.output_text.delta",
                item_id=self.open.id,
                output_index=self.index,
                content_index=0,
                delta=delta,
                logprobs=[],
            )

    def call(self, delta: dict):
        fn = delta.get("function") or {}
        item = self.calls.get(delta["index"])
        if item is None:
            yield from self.close()
            item = FunctionCallItem(
                id=new_item_id("fc"),
                call_id=delta.get("id") or new_item_id("call"),
                name=fn.get("name") or "",
                arguments="",
            )
            item.status = "in_progress"
            self.calls[delta["index"]] = item
            self.items.append(item)
            self.open = item
            yield self.event("response.output_item.added", output_index=self.index, item=item)
        if fn.get("arguments"):
            item.arguments += fn["arguments"]
            yield self.event(
                "response.function_call_arguments.delta",
                item_id=item.id,
                output_index=self.items.index(item),
                delta=fn["arguments"],
            )


async def stream_events(turn: Turn, store: ResponseStore, chat_chunks):
    """Events for `turn` from the chat endpoint's SSE body (`data: <chunk JSON>` strings, then [DONE])."""
    event = _Events()
    out = _Output(event)
    started = turn.response([], None, "in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    finish, usage = None, None
    async with aclosing(chat_chunks) as chunks:
        async for frame in chunks:
            data = frame.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                failed = turn.response(out.items, None, "failed")
                failed.error = ResponseError(code="server_error", message=chunk["error"]["message"])
                yield event("response.failed", response=failed)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    for e in out.reasoning(delta["reasoning_content"]):
                        yield e
                if delta.get("content"):
                    for e in out.text(delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or []:
                    for e in out.call(call):
                        yield e
                finish = choice.get("finish_reason") or finish
    if not any(
        not isinstance(i, ReasoningItem) for i in out.items
    ):  # no text, no call: an empty message as stream=false
        for e in out.text(""):
            yield e
    for e in out.close():
        yield e
    status = "incomplete" if finish == "length" else "completed"
    body = turn.response(out.items, usage_of(usage), status)
    turn.remember(store, body)
    yield event(f"response.{status}", response=body)
