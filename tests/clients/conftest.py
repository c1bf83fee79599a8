"""Real clients (tests/clients/): one `petrel serve` app on the real default model for the whole directory."""

from __future__ import annotations

import pytest

from petrel.serve import build_app
from petrel.serve.server import BackgroundServer


@pytest.fixture(scope="session")
def served(llm):
    """The server's base URL (no /v1), on the session's default-model engine (tests/conftest.py `llm`)."""
    with BackgroundServer(build_app(llm, max_n=4)) as srv:
        yield srv.url


@pytest.fixture(scope="session")
def base_url(served) -> str:
    """What OpenAI-compatible clients take as base_url."""
    return f"{served}/v1"
