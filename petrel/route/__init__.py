"""`petrel route`: a prefix- and load-aware OpenAI-compatible front over several petrel servers, or (with
--prefill and --decode) the front of a disaggregated pair.

The router's classes are imported when first used (`from petrel.route import Router`), so that `petrel --help`
and the command's options do not import the router's web stack before it runs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "Backend": "petrel.route.router",
    "Router": "petrel.route.router",
    "build_router_app": "petrel.route.router",
    "prefix_of": "petrel.route.router",
    "build_disagg_app": "petrel.route.disagg",
}
__all__ = ["Backend", "Router", "build_router_app", "build_disagg_app", "prefix_of", "add_arguments", "run"]


def __getattr__(name: str):
    """Import a public name's module on first use, and keep the name here so later lookups are plain ones."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'petrel.route' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # for type checkers and editors only
    from petrel.route.disagg import build_disagg_app
    from petrel.route.router import Backend, Router, build_router_app, prefix_of


def add_arguments(p):
    """The options of `petrel route` on parser `p`; returns `p`."""
    from petrel.route.router import DEFAULT_BACKEND_TIMEOUT
    from petrel.serve.limits import DEFAULT_MAX_REQUEST_BYTES

    p.add_argument(
        "--backends",
        nargs="+",
        metavar="URL",
        help="the petrel servers to spread requests over, e.g. http://10.0.0.2:8000 http://10.0.0.3:8000",
    )
    p.add_argument("--prefill", metavar="URL", help="disaggregated serving: the server that prefills (with --decode)")
    p.add_argument("--decode", metavar="URL", help="disaggregated serving: the server that decodes (with --prefill)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=256,
        help="requests whose prompts agree on this many first characters go to the same backend",
    )
    p.add_argument(
        "--max-imbalance",
        type=int,
        default=8,
        help="a backend with this many more requests in flight than the least loaded one is passed over",
    )
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    p.add_argument(
        "--backend-timeout",
        type=float,
        default=DEFAULT_BACKEND_TIMEOUT,
        help="seconds a backend may send nothing at all (no byte of the answer awaited, no health-check "
        "reply) before the router gives up on it: the request goes to the next backend, or gets 504 "
        "(a stream: a final error event). A busy backend still answers health checks, so long "
        "generations are not cut short; at least 3 x max(1, --health-interval)",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="larger request bodies get 413"
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def run(args) -> int:
    import logging
    import sys

    import uvicorn

    from petrel.route.disagg import build_disagg_app
    from petrel.route.router import Router, build_router_app
    from petrel.serve.connections import (
        DEFAULT_HEADER_TIMEOUT,
        ConnectionGuard,
        default_max_connections,
        guarded_config,
        raise_open_file_limit,
    )

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (args.prefill is None) != (args.decode is None) or (args.prefill is not None) == bool(args.backends):
        raise ValueError("route needs either --backends URL ... or both --prefill URL and --decode URL")
    if args.prefill is not None:
        app = build_disagg_app(
            args.prefill, args.decode, args.health_interval, max_request_bytes=args.max_request_bytes
        )
        print(
            f"petrel route: http://{args.host}:{args.port}/v1, prefill on {args.prefill}, decode on {args.decode}",
            file=sys.stderr,
            flush=True,
        )
    else:
        router = Router(args.backends, args.prefix_chars, args.max_imbalance)
        app = build_router_app(
            router, args.health_interval, backend_timeout=args.backend_timeout, max_request_bytes=args.max_request_bytes
        )
        print(
            f"petrel route: http://{args.host}:{args.port}/v1 over {len(router.backends)} backend(s): "
            f"{', '.join(b.url for b in router.backends)}",
            file=sys.stderr,
            flush=True,
        )
    # the same connection guard as `petrel serve`: header deadline, connection cap, rate-limited exhaustion logs
    guard = ConnectionGuard(DEFAULT_HEADER_TIMEOUT, default_max_connections(raise_open_file_limit()))
    uvicorn.Server(guarded_config(app, guard, host=args.host, port=args.port, log_level=args.log_level)).run()
    return 0
