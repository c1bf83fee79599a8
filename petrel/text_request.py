"""TextGenerationRequest: one immutable request (prompt or chat messages, tools, options) that the LLM accepts.

The fields are those of a serving request type (MAX's TextGenerationRequest) that apply to a text engine.
`LLM.generate_async(request)` and `LLM.generate([...requests])` take it; `resolve()` turns it into what
the engine runs: the prompt's token ids and the SamplingParams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from petrel.guided_decoding import GuidedDecodingParams
from petrel.model.tokenizer import chat_prompt
from petrel.sampling_params import SamplingParams

MAX_CACHE_SALT_CHARS = 512


@dataclass(frozen=True)
class TextGenerationRequest:
    request_id: Any
    model_name: str | None = None  # must name the loaded model when given
    prompt: str | Sequence[int] | None = None  # text or token ids (exclusive with messages)
    messages: list[dict] = field(default_factory=list)  # chat turns: {"role": ..., "content": ...}
    tools: list[dict] | None = None  # function tools, rendered through the chat template
    response_format: dict | None = None  # structured output: json_object or json_schema (guided decoding)
    timestamp_ns: int = 0  # when the client sent it (kept, not interpreted)
    request_path: str = "/"
    logprobs: int = 0  # top logprobs per generated token (0: none)
    echo: bool = False  # also score the prompt (prompt logprobs when logprobs > 0)
    chat_template_options: dict | None = None  # extra chat-template variables (add_generation_prompt, ...)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    target_endpoint: str | None = None  # routing hint for a multi-engine deployment (one engine here)
    cache_salt: str | None = None  # isolates this request's prefix-cache entries

    def __post_init__(self):
        if (self.prompt is None) == (not self.messages):
            raise ValueError("exactly one of prompt and messages must be given")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
        if not isinstance(self.logprobs, int) or self.logprobs < 0:
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.response_format is not None:
            self._guided_decoding()  # validates it
        if self.tools is not None and not self.messages:
            raise ValueError("tools need chat messages")

    def _guided_decoding(self) -> GuidedDecodingParams | None:
        """response_format ({"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}})
        as guided decoding."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return GuidedDecodingParams(json_object=True)
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            return GuidedDecodingParams(json=schema)
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    def resolve(self, tokenizer, model_names: Sequence[str]) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text, prompt token ids, sampling params) for the engine."""
        if self.model_name and self.model_name not in model_names:
            raise ValueError(
                f"model_name {self.model_name!r} is not loaded here; this engine serves {list(model_names)}"
            )
        if self.messages:
            options = dict(self.chat_template_options or {})
            add_generation_prompt = options.pop("add_generation_prompt", True)
            if self.tools is not None:
                options["tools"] = self.tools
            rendered = chat_prompt(tokenizer, list(self.messages), add_generation_prompt, options)
            text, ids = rendered["prompt"], rendered["prompt_token_ids"]
        elif isinstance(self.prompt, str):
            text, ids = self.prompt, tokenizer(self.prompt)["input_ids"]
        else:
            text, ids = None, list(self.prompt)
        params = self.sampling_params
        changes = {}
        guided = self._guided_decoding()
        if guided is not None:
            if params.guided_decoding is not None:
                raise ValueError("response_format and sampling_params.guided_decoding are both set")
            changes["guided_decoding"] = guided
        if self.logprobs:
            changes["logprobs"] = self.logprobs
            if self.echo:
                changes["prompt_logprobs"] = self.logprobs
        if changes:
            params = dataclasses.replace(params, **changes)
        return text, ids, params
