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
from petrel.kv_tiers.dkv_hint import parse_dkv_cache_hint
from petrel.model.tokenizer import chat_prompt
from petrel.sampling_params import SamplingParams

MAX_CACHE_SALT_CHARS = 512
MAX_REQUEST_PATH_CHARS = 128


@dataclass(frozen=True)
class TextGenerationRequest:
    request_id: Any
    model_name: str | None = None  # must name the loaded model when given
    prompt: str | Sequence[int] | None = None  # text or token ids (exclusive with messages)
    messages: list[dict] = field(default_factory=list)  # chat turns: {"role": ..., "content": ...}
    # a vision-language model's images, in the order of the prompt's placeholders (an <image> in a text prompt, an
    # image / image_url part in messages); a text-only model refuses them
    images: list[bytes] = field(default_factory=list)  # encoded image bytes, decoded once at admission
    # videos (encoded bytes, or a video's frames) for a model that takes them (Qwen2-VL), in the order of the
    # prompt's video placeholders; other models refuse them
    videos: list[Any] = field(default_factory=list)
    decoded_images: list[Any] = field(default_factory=list)  # PIL images matching `images` 1:1 (used instead)
    # function tools ({"type": "function", "function": {...}}): rendered into the prompt as `petrel serve` does,
    # and each finished sequence's tool calls parsed into CompletionOutput.tool_calls
    tools: list[dict] | None = None
    response_format: dict | None = None  # structured output: json_object or json_schema (guided decoding)
    timestamp_ns: int = 0  # wall-clock time.time_ns() the request was received; > 0: queue time counts from it
    request_path: str = "/"  # in the request's log line and its perf metrics (normalized: no query, capped)
    logprobs: int = 0  # top logprobs per generated token (0: none)
    echo: bool = False  # the output's text starts with the prompt's text (and prompt logprobs when logprobs > 0)
    chat_template_options: dict | None = None  # extra chat-template variables (add_generation_prompt, ...)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    target_endpoint: str | None = None  # routing hint: `petrel route` routes by it; a lone engine refuses a value
    # blocks the shared KV store holds ({"block_hashes": [hex, ...]} and/or {"num_cached_tokens": N}, see
    # petrel/kv_tiers/dkv_hint.py): fetched before prefill when the engine has a store, checked against the chain
    dkv_cache_hint: dict[str, Any] | None = None
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
        if self.tools is not None:
            if not self.messages:
                raise ValueError("tools need chat messages")
            if not isinstance(self.tools, list) or not all(isinstance(t, dict) for t in self.tools):
                raise ValueError("tools must be a list of tool objects (dicts)")
        if isinstance(self.timestamp_ns, bool) or not isinstance(self.timestamp_ns, int) or self.timestamp_ns < 0:
            raise ValueError(f"timestamp_ns must be an integer >= 0 (time.time_ns()), got {self.timestamp_ns!r}")
        if not isinstance(self.request_path, str):
            raise ValueError(f"request_path must be a string, got {type(self.request_path).__name__}")
        parse_dkv_cache_hint(self.dkv_cache_hint)  # ValueError naming dkv_cache_hint
        for name in ("images", "videos", "decoded_images"):
            if not isinstance(getattr(self, name), list):
                raise ValueError(f"{name} must be a list")

    def images_for_processing(self) -> list[Any]:
        """The images for preprocessing: the pre-decoded `decoded_images` when there are any, else `images` bytes."""
        return list(self.decoded_images) if self.decoded_images else list(self.images)

    @property
    def number_of_images(self) -> int:
        """Image-type content parts across all messages."""
        return _count_parts(self.messages, ("image", "image_url"))

    @property
    def number_of_videos(self) -> int:
        """Video-type content parts across all messages."""
        return _count_parts(self.messages, ("video", "video_url"))

    @property
    def normalized_request_path(self) -> str:
        """request_path as logs and metrics carry it: no query or fragment, at most MAX_REQUEST_PATH_CHARS."""
        return normalize_request_path(self.request_path)

    def _refuse_unsupported(self, takes_images: bool, takes_videos: bool = False) -> None:
        """ValueError naming what this engine cannot honour (takes_images: the model has an image processor;
        takes_videos: it takes videos too)."""
        if self.target_endpoint:
            raise ValueError(
                f"target_endpoint {self.target_endpoint!r}: this is one engine, not a router; "
                "route by target_endpoint with `petrel route`"
            )
        for name, count in (
            ("images", len(self.images)),
            ("decoded_images", len(self.decoded_images)),
            ("videos", len(self.videos)),
            ("messages (image content)", self.number_of_images),
            ("messages (video content)", self.number_of_videos),
        ):
            if count and not takes_images:
                raise ValueError(f"{name}: this model has no vision input (text only)")
            if count and "video" in name and not takes_videos:
                raise ValueError(f"{name}: this model takes no video input")

    def multi_modal_inputs(self, processor, ids: list[int], limits: dict | None, max_pixels: int):
        """(token ids, MultiModalInputs or None): the images (decoded_images, else images decoded once now) and
        videos put in place of the prompt's placeholders by the model's processor."""
        from petrel.multimodal.prompts import as_images, as_videos

        if self.decoded_images and self.images and len(self.decoded_images) != len(self.images):
            raise ValueError(
                f"decoded_images: {len(self.decoded_images)} for {len(self.images)} images (they match 1:1)"
            )
        name = "decoded_images" if self.decoded_images else "images"
        images = as_images(self.images_for_processing(), name, (limits or {}).get("image"), max_pixels)
        media = {"videos": as_videos(processor, self.videos, "videos", limits, max_pixels)} if self.videos else {}
        return processor.process(ids, images, **media)  # without media: checks the prompt has no placeholder

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

    def resolve(
        self, tokenizer, model_names: Sequence[str], takes_images: bool = False, takes_videos: bool = False
    ) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text, prompt token ids, sampling params) for the engine; the ids hold one placeholder per image
        and video (multi_modal_inputs expands them). takes_images: the model has an image processor; takes_videos:
        it takes videos too."""
        if self.model_name and self.model_name not in model_names:
            raise ValueError(
                f"model_name {self.model_name!r} is not loaded here; this engine serves {list(model_names)}"
            )
        self._refuse_unsupported(takes_images, takes_videos)
        if self.messages:
            options = dict(self.chat_template_options or {})
            add_generation_prompt = options.pop("add_generation_prompt", True)
            messages = [_image_parts_for_template(m) for m in self.messages]
            if self.tools is not None:
                text, ids = _render_with_tools(tokenizer, messages, self.tools, add_generation_prompt, options)
            else:
                rendered = chat_prompt(tokenizer, messages, add_generation_prompt, options)
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


def normalize_request_path(path: str) -> str:
    """A request path fit for a log line or a metric: no query or fragment, printable, at most
    MAX_REQUEST_PATH_CHARS characters (a path is user input: this bounds what a metric may carry)."""
    path = path.split("?", 1)[0].split("#", 1)[0]
    path = "".join(c if c.isprintable() and not c.isspace() else "_" for c in path) or "/"
    return path[:MAX_REQUEST_PATH_CHARS]


def _image_parts_for_template(message):
    """A message with its image_url / video_url parts as the {"type": "image"} / {"type": "video"} parts chat
    templates place media by."""
    content = message.get("content") if isinstance(message, dict) else None
    kinds = {"image_url": "image", "video_url": "video"}
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in kinds for p in content):
        return message
    parts = [{"type": kinds[p["type"]]} if isinstance(p, dict) and p.get("type") in kinds else p for p in content]
    return {**message, "content": parts}


def _count_parts(messages: list[dict], kinds: tuple[str, ...]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") in kinds
    )


def _render_with_tools(tokenizer, messages, tools, add_generation_prompt, options) -> tuple[str, list[int]]:
    """The prompt `petrel serve` builds for these messages and tools (its ChatTemplate, shared)."""
    from petrel.serve.chat_template import ChatTemplate
    from petrel.serve.errors import APIError

    try:
        return ChatTemplate(tokenizer).prompt(messages, tools, add_generation_prompt, False, options)
    except APIError as exc:
        raise ValueError(str(exc)) from None
