"""A Responses request -> the chat messages, tools and options of the Chat Completions request that runs it.

The Responses API is served by the chat path (chat.create_chat_completion): its chat template, tool prompt,
tool grammar and tool parser. This module only translates: input items to chat messages, flat function tools to
chat tools, `text.format` to `response_format`, and refuses (400, naming the field) what petrel cannot honour.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from petrel.serve.errors import APIError
from petrel.serve.protocol import MAX_MESSAGES, ChatCompletionRequest
from petrel.serve.responses_protocol import ResponsesRequest

# refused when set to anything but these values (None: refused whenever given)
_REFUSED = {
    "background": (None, False),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "conversation": (None,),
    "prompt": (None,),
    "context_management": (None,),
    "prompt_cache_options": (None,),
}
_REASONS = {
    "background": "background responses are not supported (a request is answered while its client waits)",
    "conversation": "conversations are not supported: chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported",
}
_TEXT_PARTS = ("input_text", "output_text", "text")


def check_refused(req: ResponsesRequest) -> None:
    for name, allowed in _REFUSED.items():
        value = getattr(req, name)
        if not any(value is a or (a is not None and value == a) for a in allowed):
            raise APIError(f"{name}: {_REASONS.get(name, 'not supported by petrel')}", 400, param=name)
    reasoning = req.reasoning or {}
    for key in sorted(set(reasoning) - {"effort"}):
        if key in ("summary", "generate_summary") and reasoning[key] is None:
            continue
        why = (
            "no summaries are made (the reasoning comes whole, as reasoning_text)" if "summary" in key else "effort is"
        )
        raise APIError(f"reasoning.{key}: not supported ({why})", 400, param=f"reasoning.{key}")
    if reasoning.get("effort") not in (None, "none", "minimal", "low", "medium", "high"):
        raise APIError(
            f"reasoning.effort {reasoning['effort']!r} must be none, minimal, low, medium or high",
            400,
            param="reasoning.effort",
        )
    if req.include:
        raise APIError(f"include: petrel adds no extra output data (asked for {req.include})", 400, param="include")
    if req.truncation == "auto":
        raise APIError("truncation 'auto' is not supported: only 'disabled'", 400, param="truncation")


def _text(content, where: str) -> str:
    """A message's content: a string, or parts of which only text parts are supported."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of content parts", 400, param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise APIError(
                f"{where}.content[{j}]: content part type {kind!r} is not supported (only text parts: "
                f"{', '.join(_TEXT_PARTS)})",
                400,
                param=f"{where}.content[{j}].type",
            )
    return "".join(texts)


def _need_str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where}.{key} is required (a string)", 400, param=f"{where}.{key}")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Chat messages for the input: a string is one user message; function_call items become the tool_calls of
    an assistant message (consecutive ones share it) and function_call_output items tool messages; reasoning items
    (a reasoning model's earlier reasoning, sent back) are dropped, as its format drops them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    f"{where}.role must be user, assistant, system or developer, got {role!r}",
                    400,
                    param=f"{where}.role",
                )
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _need_str(item, "call_id", where),
                "type": "function",
                "function": {"name": _need_str(item, "name", where), "arguments": _need_str(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue
        elif kind == "function_call_output":
            output = item.get("output")
            output = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": _need_str(item, "call_id", where), "content": output})
        else:
            raise APIError(
                f"{where}: input item type {kind!r} is not supported (message, function_call, "
                "function_call_output are)",
                400,
                param=f"{where}.type",
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                f"tools[{i}]: tool type {kind!r} is not supported (built-in tools run on OpenAI's servers); "
                "only function tools are",
                400,
                param=f"tools[{i}].type",
            )
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise APIError(f"tools[{i}]: unsupported keys {sorted(extra)}", 400, param=f"tools[{i}]")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        f"tool_choice {json.dumps(choice)[:200]} is not supported: use none, auto, required or "
        '{"type": "function", "name": ...}',
        400,
        param="tool_choice",
    )


def response_format(text) -> dict | None:
    fmt = None if text is None else text.format
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise APIError(f"text.format: unsupported keys {sorted(extra)}", 400, param="text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(
        f"text.format type {kind!r} is not supported (text, json_object, json_schema are)", 400, param="text.format"
    )


# chat field names in errors -> the Responses field the client sent
_RENAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


_CHAT_TOOL = re.compile(r"\btools\.(\d+)\.function\.")  # a chat tool's field -> the flat Responses tool's


def rename_error(exc: APIError) -> APIError:
    message = _CHAT_TOOL.sub(r"tools[\1].", exc.message)
    for chat, ours in _RENAMES.items():
        message = message.replace(chat, ours)
    param = _RENAMES.get(exc.param, exc.param) if exc.param else exc.param
    param = _CHAT_TOOL.sub(r"tools[\1].", param) if param else param
    return APIError(message, exc.status, param=param, code=exc.code, type=exc.type)


def chat_request(req: ResponsesRequest, history: list[dict], stream: bool) -> ChatCompletionRequest:
    """The chat request that runs `req` after the `history` of messages (its previous responses)."""
    messages = list(history)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    messages += input_messages(req.input)
    if len(messages) > MAX_MESSAGES:  # the input alone was counted; with previous_response_id's conversation:
        raise APIError(
            f"input: with the conversation of previous_response_id this is {len(messages)} messages; at most "
            f"{MAX_MESSAGES} are accepted",
            400,
            param="input",
        )
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": response_format(req.text),
        "stream": stream,
        "cache_salt": req.cache_salt,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = list(err["loc"])
        param = "input" if loc[:1] == ["messages"] else ".".join(str(p) for p in loc[:2] if p != "function")
        if loc[:1] == ["tools"] and len(loc) > 1:
            param = f"tools[{loc[1]}]"
        if loc[:1] == ["response_format"]:
            param = "text.format"
        raise APIError(f"{param}: {err['msg']}", 400, param=param) from None
