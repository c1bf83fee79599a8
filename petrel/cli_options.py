"""Command-line options that more than one command takes: `petrel generate | chat` (petrel/cli.py), `petrel serve`
(petrel/serve/server.py) and `petrel bench` (petrel/bench/) define them from here, so each command's
module depends on this one and none on another command's."""

from __future__ import annotations

import argparse
import json


def parse_choices(text: str, known, what: str) -> list[str]:
    """A comma-separated option as a list, every item one of `known` (SystemExit naming one that is not)."""
    items = [x.strip().lower() for x in text.split(",") if x.strip()]
    for x in items:
        if x not in known:
            raise SystemExit(f"unknown {what} {x!r}; known: {', '.join(known)}")
    return items


def speculative_config_json(text: str) -> dict:
    """argparse type of --speculative-config: a JSON object (checked when the engine starts)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def parallel_arguments(p) -> None:
    """--tensor-parallel-size and --distributed-executor-backend (generate, chat, serve, bench)."""
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=None,
        metavar="N",
        help="split the model over N ranks: this process and N-1 workers (default 1)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default=None,
        help="how the workers run: local processes (mp, the default) or Ray actors (ray; joins the "
        "cluster at RAY_ADDRESS when set)",
    )


def parallel_options(args) -> dict:
    """The LLM / EngineConfig keywords of the options parallel_arguments added, only those given."""
    options = {}
    if args.tensor_parallel_size is not None:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    if args.distributed_executor_backend is not None:
        options["distributed_executor_backend"] = args.distributed_executor_backend
    return options
