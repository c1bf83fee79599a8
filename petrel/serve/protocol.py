"""The OpenAI wire format as pydantic models: requests (validated, unknown fields refused) and responses.

Requests forbid unknown fields, so a parameter petrel does not know is a 400 naming it rather than a
silently ignored one. petrel's own extras (top_k, min_p, ...) are listed after the OpenAI fields.
Responses drop the optional keys OpenAI leaves out (a delta's missing role, a message without tool calls).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from petrel.kv_tiers.dkv_hint import MAX_HINT_HASHES

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI: 5 legacy, 20 chat)


class _Request(BaseModel):
    # strict: JSON types as OpenAI's API takes them (`"n": "2"`, `"max_tokens": true` or `"prompt": [true]` are
    # refused, not coerced); an integer still counts as a number
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        """JSON may escape half a UTF-16 pair (\\ud800): such a string is no text the tokenizer can encode."""
        _check_text(value)
        return value


MAX_ITEMS = 2**18  # most items of any one list or object in a request: more than any context holds as token ids

# Most items of the lists whose every item costs work before the prompt exists (each tool's schema is checked and
# written into the prompt, each message and content part validated and rendered): OpenAI's own limits. A longer
# list is refused naming its field before any of its items is looked at (50,000 tools were validated for 10-20 s
# on the event loop; 200,000 messages took 9-13 s to refuse).
MAX_TOOLS = 128  # tools (or legacy functions) per request: OpenAI's limit, "a max of 128 functions"
MAX_MESSAGES = 2048  # chat messages, or Responses input items, per request: OpenAI refuses longer arrays
MAX_CONTENT_PARTS = 2048  # content parts in all of a request's messages (or input items) together


def check_count(value: Any, limit: int, field: str, what: str) -> None:
    """ValueError when `value` (the request's JSON, not yet validated) is a list of more than `limit` items."""
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"{field} has {len(value)} {what}; at most {limit} are accepted")


def check_messages(value: Any, field: str = "messages", what: str = "messages") -> None:
    """At most MAX_MESSAGES messages (input items) holding at most MAX_CONTENT_PARTS content parts together,
    counted on the request's JSON before any message is validated."""
    check_count(value, MAX_MESSAGES, field, what)
    if not isinstance(value, list):
        return
    parts = 0
    for i, message in enumerate(value):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts += len(content)
            if parts > MAX_CONTENT_PARTS:
                raise ValueError(
                    f"{field}.{i}.content: the {what} hold more than {MAX_CONTENT_PARTS} content parts together; "
                    f"at most {MAX_CONTENT_PARTS} are accepted"
                )


def _check_text(value: Any) -> None:
    """Every string in value, at any depth (a walk with its own stack: JSON nesting is no recursion limit here),
    and no list or object of more than MAX_ITEMS items (validating 2M token ids held the event loop for seconds)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple, dict)) and len(item) > MAX_ITEMS:
            raise ValueError(f"a list or object of {len(item)} items: at most {MAX_ITEMS} are accepted")
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(
                        f"the text has a lone UTF-16 surrogate ({item[exc.start]!r} at character "
                        f"{exc.start}), which is not valid Unicode"
                    ) from None
        elif isinstance(item, (list, tuple)):
            stack.extend(x for x in item if not isinstance(x, (int, float)))
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    _omit_none: tuple[str, ...] = ()  # keys written only when set

    # no return annotation: pydantic would take it for the responses' serialization schema (the OpenAPI document's)
    @model_serializer(mode="wrap")
    def _drop_unset_optionals(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        data = handler(self)
        for key in self._omit_none:
            if data.get(key, 0) is None:
                del data[key]
        return data


# ------------------------------------------------------------------------------------------ shared pieces


class StreamOptions(_Request):
    include_usage: bool = False


class DisaggregatedParamsField(_Request):
    """Disaggregated serving (TensorRT-LLM's names): context_only prefills here and returns these parameters on
    its choice; generation_only (on another server) carries them back, with the same prompt, to decode."""

    request_type: Literal["context_only", "generation_only", "context_and_generation"]
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | str | None = None
    opaque_state: str | None = Field(None, description="the KV transfer handle a context_only answer returned")
    draft_tokens: list[int] | None = None
    ctx_info_endpoint: str | None = Field(None, description="host:port of the context server's KV transfer server")


class DkvCacheHintField(_Request):
    """dkv_cache_hint (MAX's distributed-KV hint, petrel/kv_tiers/dkv_hint.py): blocks the shared KV store holds,
    fetched before prefill; hashes outside the request's own hash chain are ignored."""

    block_hashes: list[Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]] | None = Field(
        None, max_length=MAX_HINT_HASHES, description="the blocks' chain hashes (sha256, 64 hex digits)"
    )
    num_cached_tokens: int | None = Field(None, ge=0, description="the store holds the prompt's first N tokens")


class SamplingExtras(_Request):
    """petrel's sampling options beyond OpenAI's (vLLM-compatible names)."""

    top_k: int | None = Field(None, description="keep the k most likely tokens; 0 or -1 keeps all")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    cache_salt: str | None = Field(
        None, max_length=512, description="requests with different salts never share prefix-cache blocks"
    )
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = Field(False, description="add prompt_token_ids and token_ids to each choice")
    # guided (constrained) decoding: at most one of these (and, in chat, of response_format) per request
    guided_json: dict[str, Any] | str | None = Field(
        None, description="constrain the output to this JSON schema (an object, or its JSON text)"
    )
    guided_regex: str | None = Field(None, description="constrain the output to match this regular expression")
    guided_grammar: str | None = Field(
        None, description="constrain the output to this EBNF grammar (xgrammar's GBNF dialect, start rule `root`)"
    )
    guided_choice: list[str] | None = Field(
        None, min_length=1, description="the output is exactly one of these strings"
    )
    disaggregated_params: DisaggregatedParamsField | None = None
    dkv_cache_hint: DkvCacheHintField | None = None

    def dkv_hint(self) -> dict[str, Any] | None:
        """dkv_cache_hint as LLM.generate_async takes it."""
        return None if self.dkv_cache_hint is None else self.dkv_cache_hint.model_dump(exclude_none=True)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class KVTransferUsage(_Response):
    bytes: int
    seconds: float
    tokens: int


class Usage(_Response):
    _omit_none = ("kv_transfer",)
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    kv_transfer: KVTransferUsage | None = None  # a generation_only request: its prompt's KV fetch


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ------------------------------------------------------------------------------------------ /v1/completions

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingExtras):
    model: str | None = Field(None, description="the served model name (optional: there is one model)")
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, description="0 (with echo): score the prompt, generate nothing")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1, description="only None or equal to n (no re-ranking)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    suffix: str | None = Field(None, description="refused: no served model template has fill-in-the-middle tokens")


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    _omit_none = ("stop_reason", "token_ids", "prompt_token_ids", "disaggregated_params")
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    disaggregated_params: dict[str, Any] | None = None  # a context_only answer: what generation_only needs


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE event of a streamed completion (the same object as the response, OpenAI's legacy shape)."""


# ------------------------------------------------------------------------------------------ /v1/chat/completions


class ImageURL(_Request):
    url: str
    detail: Literal["auto"] | None = None  # the model's processor decides the resolution: only 'auto'


class ContentPart(_Request):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # type 'image_url' (a vision-language model)
    video_url: ImageURL | None = None  # type 'video_url' (a model that takes videos: Qwen2-VL, Qwen2.5-VL)


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="a JSON schema (checked against its metaschema off the event loop: tool_schemas.py)"
    )
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True, strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="a name for the output format")
    description: str | None = Field(None, description="what the output is for (not used to constrain it)")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="the JSON schema the output must match (required here)"
    )
    strict: bool | None = Field(None, description="accepted; petrel always constrains the output to the schema")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: free text; json_object: any JSON object; json_schema: JSON matching json_schema.schema"
    )
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema: the schema")


# Fields OpenAI's SDKs send that have no effect on a local engine: accepted (type-checked) and ignored. The README's
# "Accepted and ignored" list is this one. (prompt_cache_key, modalities, parallel_tool_calls, functions and
# function_call have a meaning here: see OpenAIClientFields and ChatCompletionRequest.)
ACCEPTED_AND_IGNORED = (
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "user",
    "verbosity",
)


class OpenAIClientFields(_Request):
    store: bool | None = Field(None, description="accepted and ignored: petrel stores no completions")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted and ignored: there is one tier"
    )
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    user: str | None = Field(None, description="accepted and ignored")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted and ignored")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None,
        description="the chat template's reasoning_effort variable (gpt-oss's `Reasoning:` line; none and minimal "
        "are its low)",
    )
    prompt_cache_key: str | None = Field(
        None,
        max_length=512,
        description="`petrel route` sends requests with the same key to the same backend (so they meet one prefix "
        "cache); one server shares its prefix cache across all requests anyway",
    )
    modalities: list[str] | None = Field(None, description='["text"] only: petrel writes no audio')


class ChatCompletionRequest(SamplingExtras, OpenAIClientFields):
    model: str | None = Field(None, description="the served model name (optional: there is one model)")
    messages: list[ChatMessage] = Field(
        min_length=1, description=f"at most {MAX_MESSAGES}, with at most {MAX_CONTENT_PARTS} content parts together"
    )
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated name of max_completion_tokens")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, description=f"at most {MAX_TOOLS}")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call per choice")
    functions: list[FunctionDefinition] | None = Field(
        None, description="deprecated form of tools: answered with message.function_call"
    )
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(
        None, description="deprecated form of tool_choice (with functions)"
    )
    response_format: ResponseFormat | None = None
    # chat-template controls (vLLM-compatible names)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, value: Any) -> Any:
        check_messages(value)
        return value

    @field_validator("tools", "functions", mode="before")
    @classmethod
    def _bounded_tools(cls, value: Any, info: ValidationInfo) -> Any:
        field = info.field_name or "tools"  # a field validator always has its field's name
        check_count(value, MAX_TOOLS, field, field)
        return value


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ResponseMessage(_Response):
    _omit_none = ("tool_calls", "function_call", "reasoning_content")
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's <think> part (petrel/serve/reasoning.py)
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # a request with the deprecated `functions`


ChatFinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class ChatChoice(_Response):
    _omit_none = ("stop_reason", "token_ids", "disaggregated_params")
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    disaggregated_params: dict[str, Any] | None = None  # a context_only answer: what generation_only needs


class ChatCompletionResponse(_Response):
    _omit_none = ("prompt_token_ids",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(_Response):
    _omit_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    _omit_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    _omit_none = ("role", "content", "reasoning_content", "tool_calls", "function_call")
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = None  # a request with the deprecated `functions`


class ChatStreamChoice(_Response):
    _omit_none = ("stop_reason", "token_ids")
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
