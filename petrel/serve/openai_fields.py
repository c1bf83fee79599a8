"""OpenAI chat fields that mean something here beyond their own value: `modalities` (text only) and the deprecated
`functions` / `function_call`, which become tools / tool_choice, answered in their own legacy shape (one
`message.function_call`, finish_reason "function_call"). The accepted-and-ignored fields are listed in
protocol.ACCEPTED_AND_IGNORED."""

from __future__ import annotations

from petrel.serve.errors import APIError
from petrel.serve.protocol import ChatCompletionRequest, NamedToolChoice, Tool


def check_modalities(req: ChatCompletionRequest) -> None:
    other = [m for m in req.modalities or [] if m != "text"]
    if other:
        raise APIError(
            f'modalities {other} are not supported: petrel writes text only (modalities may be ["text"])',
            400,
            param="modalities",
        )


def with_legacy_functions(req: ChatCompletionRequest) -> tuple[ChatCompletionRequest, bool]:
    """(the request with `functions` / `function_call` as tools / tool_choice, whether it used them)."""
    if req.functions is None:
        if req.function_call is not None:
            raise APIError("function_call needs functions", 400, param="function_call")
        return req, False
    if req.tools is not None or req.tool_choice is not None:
        raise APIError(
            "functions and function_call are the deprecated form of tools and tool_choice: give one form, not both",
            400,
            param="functions",
        )
    if not req.functions:
        raise APIError("functions is empty", 400, param="functions")
    choice = req.function_call
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(function=choice)
    update = {
        "tools": [Tool(function=f) for f in req.functions],
        "tool_choice": choice,
        "parallel_tool_calls": False,  # the legacy shape holds one call
        "functions": None,
        "function_call": None,
    }
    return req.model_copy(update=update), True
