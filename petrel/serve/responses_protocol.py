"""The OpenAI Responses API (POST /v1/responses) wire format as pydantic models.

The request forbids unknown fields like every other petrel request. Its `input` items and `tools` are kept as
JSON here and read by responses_input.py, so an unsupported item or tool type is a 400 naming where it is
(`input[2].type`, `tools[0].type`) rather than a wall of union-validation errors.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, field_validator

from petrel.serve.protocol import MAX_MESSAGES, MAX_TOOLS, _Request, _Response, check_count, check_messages


class ResponseTextConfig(_Request):
    format: dict[str, Any] | None = Field(
        None, description="{type: text} | {type: json_object} | {type: json_schema, name, schema, strict}"
    )
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted and ignored")


class ResponseStreamOptions(_Request):
    include_obfuscation: bool | None = Field(None, description="accepted; petrel's events carry no obfuscation")


class ResponsesRequest(_Request):
    model: str | None = Field(None, description="the served model name (optional: there is one model)")
    input: str | list[dict[str, Any]] = Field(
        description=f"text, or input items (at most {MAX_MESSAGES}): messages, function_call and "
        "function_call_output items"
    )
    instructions: str | None = Field(None, description="a system message before the input (not carried over)")
    tools: list[dict[str, Any]] | None = Field(
        None, description=f"function tools (at most {MAX_TOOLS}): {{type: function, name, ...}}"
    )
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: ResponseTextConfig | None = None
    previous_response_id: str | None = None
    store: bool = Field(True, description="keep the response for previous_response_id / GET (false: keep nothing)")
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    metadata: dict[str, str] | None = Field(None, description="returned on the response, otherwise unused")
    include: list[str] | None = Field(None, description="no extra output data is supported: only an empty list")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="only 'disabled'")
    # accepted and ignored: they mean nothing to one local engine
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # petrel's (and vLLM's) extra, as in chat
    cache_salt: str | None = Field(
        None, max_length=512, description="requests with different salts never share prefix-cache blocks"
    )
    # refused when set (a 400 naming the field): petrel cannot honour them
    background: bool | None = None
    reasoning: dict[str, Any] | None = Field(
        None,
        description="{effort: none|minimal|low|medium|high} reaches a reasoning model's template (gpt-oss's); "
        "no summaries are made (the reasoning comes whole, as reasoning_text)",
    )
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _bounded_input(cls, value):
        check_messages(value, "input", "input items")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _bounded_tools(cls, value):
        check_count(value, MAX_TOOLS, "tools", "tools")
        return value


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    """A reasoning model's reasoning before its answer (gpt-oss's analysis channel), whole as reasoning_text."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCallItem(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(_Response):
    code: str
    message: str


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    usage: ResponseUsage | None = None


class ResponseStreamEvent(_Response):
    """One SSE event of a streamed response (`event: <type>` then `data: <this JSON>`): its other keys depend on
    the type (response, item, part, delta, text, arguments, output_index, item_id, content_index)."""

    type: str
    sequence_number: int
