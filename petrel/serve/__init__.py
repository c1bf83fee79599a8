"""petrel's OpenAI-compatible HTTP server: `petrel serve`, or `build_app(llm)` for any ASGI server."""
from petrel.serve.app import build_app

__all__ = ["build_app"]
