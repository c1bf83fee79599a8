"""Grammars for forced tool calls: what the model writes after the server's prefill must be a call whose
arguments match the tool's `parameters` JSON schema, closed by </tool_call>.

Two shapes (the prefill is what the server appends to the prompt; the grammar constrains the rest):
  one function   prefill `<tool_call>\\n{"name": "<fn>", "arguments":`   grammar ` <parameters JSON>}\\n</tool_call>`
  several        prefill `<tool_call>\\n`   grammar `<one of {"name": <fn>, "arguments": <its parameters>}>\\n</tool_call>`
The JSON is compact (", " and ": " separators, no newlines), which a small model cannot pad endlessly.
The grammar is built with xgrammar and handed to the engine as EBNF text (GuidedDecodingParams.grammar).
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


def _ebnf_literal(text: str) -> str:
    return json.dumps(text)   # a JSON string literal is a valid EBNF string literal for this ASCII text


def _concat(*parts) -> str:
    xgr = _xgrammar()
    grammars = [xgr.Grammar.from_ebnf(f"root ::= {p[1]}") if p[0] == "ebnf"
                else xgr.Grammar.from_json_schema(json.dumps(p[1]), any_whitespace=False) for p in parts]
    return str(xgr.Grammar.concat(*grammars))


def named_call_grammar(parameters: dict | None) -> GuidedDecodingParams:
    """After named_prefill(name): ` <arguments object>}` then the closing tag."""
    try:
        text = _concat(("ebnf", _ebnf_literal(" ")), ("json", _parameters(parameters)),
                       ("ebnf", _ebnf_literal("}\n</tool_call>")))
    except Exception as exc:  # xgrammar refuses the schema (RuntimeError or its own error types)
        raise ValueError(f"the tool's parameters are not a JSON schema petrel can follow: {exc}") from None
    return GuidedDecodingParams(grammar=text)


def any_call_grammar(tools: list[tuple[str, dict | None]]) -> GuidedDecodingParams:
    """After CALL_START: `{"name": <one of the tools>, "arguments": <that tool's arguments>}` then the closing tag."""
    options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(parameters)},
                "required": ["name", "arguments"]} for name, parameters in tools]
    try:
        text = _concat(("json", {"anyOf": options}), ("ebnf", _ebnf_literal("\n</tool_call>")))
    except Exception as exc:
        raise ValueError(f"the tools' parameters are not JSON schemas petrel can follow: {exc}") from None
    return GuidedDecodingParams(grammar=text)
