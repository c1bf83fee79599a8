"""Chat templates: the model's Jinja template (or an override) rendered in a sandbox, tools included.

The template runs in jinja2's ImmutableSandboxedEnvironment: no attribute access to Python internals, no
mutation of the objects passed in. It sees `messages`, `tools`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`, `strftime_now` and the request's chat_template_kwargs.

A model whose tokenizer speaks harmony (gpt-oss: petrel/serve/harmony.py) is rendered by petrel's harmony renderer
instead of its Jinja template (unless --chat-template overrides it), with the request's reasoning_effort.

Tools with a template that does not mention `tools` (SmolLM2's does not): the tool list goes into the
system message as DEFAULT_TOOL_PROMPT describes, assistant tool calls are written back as Hermes-style
<tool_call> blocks and tool results keep the `tool` role, so the model sees the same format it is asked
to write.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from petrel.model.tokenizer import special_token_text
from petrel.multimodal.prompts import TEXT_ONLY
from petrel.serve import harmony
from petrel.serve.errors import APIError

# a description of the format, not an example: a small model copies an example's values (a placeholder such as
# "<name>" ended up in the arguments of forced calls)
DEFAULT_TOOL_PROMPT = (
    "You may call functions to help answer. The available functions, as JSON schemas:\n"
    "{tools}\n"
    "To call a function, answer with one block per call and nothing else. A block is the tag <tool_call> on its "
    'own line, then a JSON object on one line whose "name" is the function\'s name and whose "arguments" is an '
    "object holding a value for each of its parameters, then the tag </tool_call> on its own line.\n"
    "Each result comes back in a message from the tool role."
)


def load_template_source(value: str | None) -> str | None:
    """--chat-template: a file path or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    def __init__(self, tokenizer, override: str | None = None, trust_special_tokens: bool = False):
        """trust_special_tokens: special-token strings written in messages act as control tokens (trusted callers
        only; by default they are text, see petrel/model/special_tokens.py)."""
        self.trust_special_tokens = trust_special_tokens
        self.special_text = special_token_text(tokenizer)
        source = override if override is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):  # named templates: the default one
            source = source.get("default") or next(iter(source.values()))
        self.source: str | None = source
        self.tokenizer = tokenizer
        self.bos_token = getattr(tokenizer, "bos_token", None) or ""
        self.eos_token = getattr(tokenizer, "eos_token", None) or ""
        self.harmony = override is None and harmony.is_harmony(tokenizer)  # gpt-oss: render_conversation
        if source is not None:
            _compile(source)  # a broken override fails at start-up, not on the first request

    @property
    def supports_tools(self) -> bool:
        return self.harmony or (self.source is not None and "tools" in self.source)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
    ) -> str:
        if self.harmony:
            return self._render_harmony(messages, tools, add_generation_prompt, continue_final_message, kwargs or {})
        if self.source is None:
            raise APIError(
                "this model has no chat template: start the server with --chat-template", 400, param="messages"
            )
        kwargs = dict(kwargs or {})
        reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & set(kwargs)
        if reserved:
            raise APIError(f"chat_template_kwargs may not set {sorted(reserved)}", 400, param="chat_template_kwargs")
        if continue_final_message:
            if add_generation_prompt:
                raise APIError(
                    "continue_final_message needs add_generation_prompt=false", 400, param="continue_final_message"
                )
            if messages[-1]["role"] != "assistant" or not messages[-1].get("content"):
                raise APIError(
                    "continue_final_message needs a final assistant message with content",
                    400,
                    param="continue_final_message",
                )
        if tools and not self.supports_tools:
            messages = self._with_tool_prompt(messages, tools)
            tools = None
        try:
            text = _compile(self.source).render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise APIError(f"the chat template failed: {exc}", 400, param="messages") from None
        except Exception as exc:  # noqa: BLE001 - a template is code: ZeroDivisionError, RecursionError, MemoryError,
            # OverflowError (the sandbox's range limit), ... on these messages are the request's problem, not a 500
            raise APIError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}", 400, param="messages"
            ) from None
        if continue_final_message:
            final = messages[-1]["content"]
            if isinstance(final, list):  # a vision model's parts: the text the template wrote last
                final = next((p["text"] for p in reversed(final) if p.get("type") == "text"), "")
            at = text.rfind(final)
            if at < 0:
                raise APIError(
                    "the chat template changed the final message; cannot continue it",
                    400,
                    param="continue_final_message",
                )
            text = text[: at + len(final)]
        return text

    def encode(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
        prefill: str = "",
    ) -> list[int]:
        """Token ids of the rendered conversation followed by `prefill` (the server's own text, tokenized as
        written). Special-token strings in the request's values stay text unless trust_special_tokens."""
        return self.prompt(messages, tools, add_generation_prompt, continue_final_message, kwargs, prefill)[1]

    def prompt(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
        prefill: str = "",
    ) -> tuple[str, list[int]]:
        """(text, token ids) of the rendered conversation followed by `prefill`: what `encode` returns, with its
        text (the server and LLM.generate's TextGenerationRequest with tools both render through here)."""
        if self.trust_special_tokens:
            text = self.render(messages, tools, add_generation_prompt, continue_final_message, kwargs) + prefill
            return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]
        try:
            (messages, tools, kwargs), escapes = self.special_text.escape((messages, tools, kwargs))
            text = self.render(messages, tools, add_generation_prompt, continue_final_message, kwargs) + prefill
            return self.special_text.restore(text, escapes), self.special_text.encode(text, escapes)
        except ValueError as exc:
            raise APIError(str(exc), 400, param="messages") from None

    def _render_harmony(self, messages, tools, add_generation_prompt, continue_final_message, kwargs) -> str:
        if continue_final_message:
            raise APIError("continue_final_message is not supported with the harmony format", 400, param="messages")
        unknown = set(kwargs) - {"reasoning_effort"}
        if unknown:
            raise APIError(
                f"chat_template_kwargs {sorted(unknown)}: the harmony format takes reasoning_effort only",
                400,
                param="chat_template_kwargs",
            )
        try:
            return harmony.render_conversation(messages, tools, add_generation_prompt, kwargs.get("reasoning_effort"))
        except ValueError as exc:
            param = "reasoning_effort" if "reasoning_effort" in str(exc) else "messages"
            raise APIError(str(exc), 400, param=param) from None

    def _with_tool_prompt(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        prompt = DEFAULT_TOOL_PROMPT.format(tools=listing)
        messages = [dict(m) for m in messages]
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}" if messages[0]["content"] else prompt
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                blocks = [
                    f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, '
                    f'"arguments": {_arguments_text(c["function"]["arguments"])}}}\n</tool_call>'
                    for c in m["tool_calls"]
                ]
                m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
                del m["tool_calls"]
        return messages


def _arguments_text(arguments) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def messages_for_template(
    messages, supports_tools: bool, takes_images: bool = False, takes_videos: bool = False
) -> list[dict]:
    """Request messages (pydantic) -> the plain dicts a template reads; content parts joined into text, or for a
    model that takes images (takes_images) every content as the parts its template reads ({"type": "text",
    "text": ...} and {"type": "image"}, one per image_url part, in order; a string becomes one text part), and
    {"type": "video"} per video_url part for a model that takes videos."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.type == "image_url" and takes_images:
                    parts.append({"type": "image"})
                    continue
                if part.type == "image_url":
                    raise APIError(TEXT_ONLY, 400, param=f"messages.{i}.content.{j}.type")
                if part.type == "video_url" and takes_videos:
                    parts.append({"type": "video"})
                    continue
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"content parts of type {part.type!r} are not supported (text and image_url only)"
                        if takes_images
                        else f"content parts of type {part.type!r} are not supported (text only)",
                        400,
                        param=f"messages.{i}.content.{j}.type",
                    )
                parts.append({"type": "text", "text": part.text})
            content = parts if takes_images else "\n".join(p["text"] for p in parts)
        elif takes_images:  # vision models' templates read every content as parts
            content = [{"type": "text", "text": content}] if content else []
        role = "system" if m.role == "developer" else m.role
        d = {"role": role, "content": content if content is not None else ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if supports_tools:  # templates that know tools expect a mapping
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


def conversation_chars(messages: list[dict], tools: list[dict] | None = None) -> int:
    """Characters of the messages' contents and the tool definitions: what a prompt built from them holds at least."""
    chars = sum(
        len(c) if isinstance(c, str) else sum(len(p.get("text", "")) for p in c)
        for m in messages
        if isinstance(c := m.get("content"), (str, list))
    )
    return chars + (len(json.dumps(tools, ensure_ascii=False)) if tools else 0)
