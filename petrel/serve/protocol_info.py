"""The server's small routes' bodies: /v1/models, /tokenize, /detokenize, /health (the OpenAI-style request
and response models of completions and chat are in protocol.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from petrel.serve.protocol import ChatMessage, _Request, _Response, check_messages


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "petrel"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter: the base model it runs on
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = Field(None, description="text to tokenize (or give messages)")
    messages: list[ChatMessage] | None = Field(None, description="a conversation, run through the chat template")
    add_special_tokens: bool = Field(True, description="for prompt: let the tokenizer add its special tokens")
    add_generation_prompt: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded_messages(cls, value):
        check_messages(value)
        return value


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"
