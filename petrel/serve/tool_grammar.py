"""Grammars for forced tool calls: what the model writes after the server's prefill must be a call whose
arguments match the tool's `parameters` JSON schema, closed by </tool_call>.

Two shapes (the prefill is what the server appends to the prompt; the grammar constrains the rest):
  one function   prefill `<tool_call>\\n{"name": "<fn>", "arguments":`
                 grammar ` <parameters JSON>}\\n</tool_call>`
  several        prefill `<tool_call>\\n`
                 grammar `<one of {"name": <fn>, "arguments": <its parameters>}>\\n</tool_call>`
Each is a JSON constraint with literal text around it (GuidedDecodingParams json_prefix / json_suffix), so turning
the schemas into a grammar happens where every guided constraint compiles: in the grammar compiler's worker
processes, under its size limits and compile timeout (a `pattern` such as `a{10000}` took seconds to convert, and
used to stall the event loop). The JSON is compact (", " and ": " separators, no newlines), which a small model
cannot pad endlessly.
Without xgrammar installed (`available()` is False) the server opens the call but cannot constrain it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from petrel.engine.grammar import _xgrammar
from petrel.guided_decoding import GuidedDecodingParams

CALL_START = "<tool_call>\n"
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@functools.cache
def available() -> bool:
    try:
        _xgrammar()
    except ValueError:
        return False
    return True


def named_prefill(name: str) -> str:
    return f'{CALL_START}{{"name": {json.dumps(name)}, "arguments":'


def _parameters(parameters: dict | None) -> dict:
    """A tool's parameters schema; none (or an empty one) means any JSON object."""
    return parameters if parameters else ANY_OBJECT


def named_call_grammar(parameters: dict | None) -> GuidedDecodingParams:
    """After named_prefill(name): ` <arguments object>}` then the closing tag."""
    return GuidedDecodingParams(
        json=_parameters(parameters), any_whitespace=False, json_prefix=" ", json_suffix="}\n</tool_call>"
    )


def any_call_grammar(tools: list[tuple[str, dict | None]]) -> GuidedDecodingParams:
    """After CALL_START: `{"name": <one of the tools>, "arguments": <that tool's arguments>}` then the closing tag."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": _parameters(parameters)},
            "required": ["name", "arguments"],
        }
        for name, parameters in tools
    ]
    return GuidedDecodingParams(json={"anyOf": options}, any_whitespace=False, json_suffix="\n</tool_call>")
