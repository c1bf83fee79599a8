"""Guided decoding options of a request -> GuidedDecodingParams, with errors naming the field the client used.

The options: chat's response_format (json_object / json_schema) and the extras guided_json, guided_regex,
guided_grammar, guided_choice (both endpoints); at most one per request. The constraint is compiled here, on
the grammar compiler's workers (petrel/engine/grammar.py), before the request is queued: a slow compile holds up
neither the event loop nor /health, and a bad, oversized or too slow schema, regex or grammar is a 400 naming its
field. The engine then finds the compiled grammar again rather than compiling it a second time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from petrel.engine.grammar import GrammarCompilerBusy
from petrel.guided_decoding import GuidedDecodingParams
from petrel.serve.errors import APIError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


@dataclass
class Guided:
    params: GuidedDecodingParams
    param: str  # the request field it came from, named in errors
    compiled: object = None  # its compiled grammar, once compile_guided has it


def guided_fields(req) -> list[str]:
    """The guided options this request sets (response_format counts unless it is 'text')."""
    given = [f for f in GUIDED_FIELDS if getattr(req, f, None) is not None]
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    return given


def guided_from_request(req) -> Guided | None:
    given = guided_fields(req)
    if not given:
        return None
    if len(given) > 1:
        raise APIError(
            f"at most one guided decoding option per request; this one sets {', '.join(given)}", 400, param=given[1]
        )
    field = given[0]
    try:
        if field == "response_format":
            params = _response_format(req.response_format)
        elif field == "guided_json":
            params = GuidedDecodingParams(json=req.guided_json)  # compact JSON: any_whitespace's default
            params.schema_text()  # not JSON, or not an object: a ValueError now
        elif field == "guided_regex":
            params = GuidedDecodingParams(regex=req.guided_regex)
        elif field == "guided_grammar":
            params = GuidedDecodingParams(grammar=req.guided_grammar)
        else:
            params = GuidedDecodingParams(choice=req.guided_choice)
    except ValueError as exc:
        raise APIError(_rename(str(exc), field), 400, param=field) from None
    return Guided(params, field)


def _response_format(fmt) -> GuidedDecodingParams:
    if fmt.type == "json_object":
        # any JSON object (xgrammar's built-in JSON grammar would also allow a top-level array)
        return GuidedDecodingParams(json={"type": "object"})
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(
            "response_format type 'json_schema' needs json_schema.schema (the JSON schema to follow)",
            400,
            param="response_format",
        )
    return GuidedDecodingParams(json=fmt.json_schema.schema_)


def _rename(message: str, field: str) -> str:
    """The engine names guided_decoding.<kind>; the client knows the field it sent."""
    for kind in ("json_object", "json", "regex", "grammar", "choice", "structural_tag"):
        message = message.replace(f"guided_decoding.{kind}", field)
    return message.replace("guided_decoding", field)


async def compile_guided(state, guided: Guided | None) -> None:
    """Compile (and cache) the constraint on the grammar compiler's own workers, never in the event loop or asyncio's
    default executor (/health and /metrics use that one). Over a limit, malformed, or slower than the compile
    timeout: a 400 naming the field; the compiler's queue full: a 429. The compiled grammar is kept on `guided`
    until the request is queued, so the engine finds it again however busy the cache is."""
    if guided is None:
        return
    try:
        future = state.llm.engine.grammar_compiler.submit(guided.params)
        guided.compiled = await asyncio.wrap_future(future)
    except ValueError as exc:
        raise APIError(_rename(str(exc), guided.param), 400, param=guided.param) from None
    except GrammarCompilerBusy as exc:
        raise APIError(str(exc), 429, code="server_overloaded") from None


def guided_value_error(exc: ValueError, guided: Guided | None) -> APIError | None:
    """A ValueError from generate_async about the constraint, as a 400 naming the field; else None."""
    if guided is not None and "guided_decoding" in str(exc):
        return APIError(_rename(str(exc), guided.param), 400, param=guided.param)
    return None
