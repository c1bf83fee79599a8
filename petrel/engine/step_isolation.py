"""One request's failure in an engine step ends that request only: the step and the other requests in it go on.

The step keeps a `failed` dict (request id -> why) and runs each request's share of the work through `isolated`;
afterwards it aborts each failed request with its message (tests/test_step_isolation.py).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("petrel")


def isolated(failed: dict, request_id, fn, *args):
    """fn(*args), unless this request failed earlier in the step; an exception fails the request (recorded in
    `failed` with its cause, logged) instead of the step. Returns fn's result, or None."""
    if request_id in failed:
        return None
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others in its step
        logger.exception("request %r failed in an engine step", request_id)
        failed[request_id] = f"engine error in this request: {type(exc).__name__}: {exc}"
        return None
