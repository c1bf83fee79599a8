"""petrel's OpenAI-compatible HTTP server: `petrel serve`, or `build_app(llm)` for any ASGI server.

`build_app` is imported when first used, so that importing one piece of the server (petrel.serve.protocol, the
request and response models) does not build the whole app, the engine and torch with it."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["build_app"]


def __getattr__(name: str):
    """`build_app` from petrel/serve/app.py, imported on first use."""
    if name != "build_app":
        raise AttributeError(f"module 'petrel.serve' has no attribute {name!r}")
    from petrel.serve.app import build_app

    globals()["build_app"] = build_app
    return build_app


if TYPE_CHECKING:  # for type checkers and editors only
    from petrel.serve.app import build_app
