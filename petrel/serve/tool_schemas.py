"""Tool schemas checked against the JSON-Schema metaschema, off the event loop.

The tool prompt and the tool-call grammar read each tool's `parameters`, and `"properties": {"a": 5}` is no schema
to read, so each one is checked against its draft's metaschema (jsonschema). That is slow: ~0.15 ms for
`{"type": "object"}`, ~70 ms for a schema of 500 properties. Done inside pydantic while the body was parsed it held
the event loop (50,000 tools: `/health` blocked for 10-20 s); now the request's length limit (protocol.MAX_TOOLS)
comes first and the checks run on a pool of their own (ServeState.check_schemas), so neither `/health` nor the
threads that render and tokenize every prompt wait behind them.
"""

from __future__ import annotations

from petrel.serve.errors import APIError


def check_json_schema(schema: dict) -> None:
    """ValueError unless `schema` is a well-formed JSON Schema (checked against its draft's metaschema)."""
    import jsonschema
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise ValueError(f"not a valid JSON schema at {where}: {exc.message}") from None
    except RecursionError:
        raise ValueError("not a JSON schema petrel accepts: it is nested too deeply") from None


def has_tool_schemas(req) -> bool:
    """The chat request carries tools or legacy functions with parameters to check."""
    return any(function.parameters is not None for _, function in _named_functions(req))


def check_tool_schemas(req) -> None:
    """Every tool's (or legacy function's) parameters checked in order (blocking: run it off the event loop); an
    APIError naming the first that is not a JSON schema (`tools.0.function.parameters`, `functions.0.parameters`)."""
    for param, function in _named_functions(req):
        if function.parameters is None:
            continue
        try:
            check_json_schema(function.parameters)
        except ValueError as exc:
            raise APIError(f"{param}: {exc}", 400, param=param) from None


def _named_functions(req):
    if req.tools:
        return [(f"tools.{i}.function.parameters", tool.function) for i, tool in enumerate(req.tools)]
    return [(f"functions.{i}.parameters", function) for i, function in enumerate(req.functions or [])]
