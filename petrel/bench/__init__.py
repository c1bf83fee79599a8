"""petrel's benchmarks: `petrel bench` and its subcommands, on the workloads W1-W4 of the project's
bench/WORKLOADS.md.

    workloads.py   W1-W4 and W6 as token ids and sizes (numpy only: the peers' scripts import it too)
    runners.py     petrel and transformers in this process: load, warm up, a timed W1 stream, a timed batch
    in_process.py  `petrel bench [latency|throughput|prefix]`: both engines side by side on W1, W2, W4
    serve.py       `petrel bench serve`: W3, the W2 prompts streamed to any OpenAI-compatible server
    compare.py     `petrel bench compare`: petrel and every installed peer (benchmarks/peers/), one table
    tiers.py       `petrel bench tiers`: W5, many shared prefixes, with the KV tiers off / host / host + disk
    processes.py   the child processes a compare runs: scripts, servers, their trees' peak RSS
    contention.py  `compare --contention N`: competing CPU-bound processes during each engine's run
    flops.py       this machine's matmul peak, W2's arithmetic and the memory read bandwidth (W6's KV row)
    report.py      what counts as a figure, statistics, ratios, summaries, the compare's table, the sweep's plot

The names other code uses (the workloads, the runners, run_w1 / run_batch) are importable from here; each is
imported on first use, so `import petrel.bench` costs nothing and pulls in no engine.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    name: "petrel.bench.workloads"
    for name in (
        "W1_USER_MESSAGE",
        "W1_REFERENCE_IDS",
        "Sizes",
        "FULL",
        "QUICK",
        "make_w2_prompts",
        "make_w4_prompts",
        "w1_prompt_ids",
    )
}
_EXPORTS |= {
    "PetrelRunner": "petrel.bench.runners",
    "HFRunner": "petrel.bench.runners",
    "run_w1": "petrel.bench.in_process",
    "run_batch": "petrel.bench.in_process",
}
# a literal list, not derived from _EXPORTS: type checkers and ruff read __all__ statically (test_imports checks
# that the two agree)
__all__ = [
    "main",
    "W1_USER_MESSAGE",
    "W1_REFERENCE_IDS",
    "Sizes",
    "FULL",
    "QUICK",
    "make_w2_prompts",
    "make_w4_prompts",
    "w1_prompt_ids",
    "PetrelRunner",
    "HFRunner",
    "run_w1",
    "run_batch",
]


def main(argv: list[str] | None = None) -> int:
    """Entry point of `petrel bench`: 0 when every figure counts (compare: when no engine failed), 1 otherwise.

    `petrel bench tiers [options]` runs W5 with the KV tiers off and on (tiers.py);
    `petrel bench serve [options]` runs W3 against a server (serve.py); `petrel bench compare` runs petrel and every
    installed peer on W1-W4 (compare.py); anything else is `petrel bench [latency|throughput|prefix] [options]`
    (in_process.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from petrel.bench.serve import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "tiers":
        from petrel.bench.tiers import main as tiers_main

        return tiers_main(argv[1:])
    if argv and argv[0] == "compare":
        from petrel.bench.compare import main as compare_main

        return compare_main(argv[1:])
    from petrel.bench.in_process import main as in_process_main

    return in_process_main(argv)


def __getattr__(name: str):
    """Import a public name's module on first use, and keep the name here so later lookups are plain ones."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'petrel.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # for type checkers and editors only
    from petrel.bench.in_process import run_batch, run_w1
    from petrel.bench.runners import HFRunner, PetrelRunner
    from petrel.bench.workloads import (
        FULL,
        QUICK,
        W1_REFERENCE_IDS,
        W1_USER_MESSAGE,
        Sizes,
        make_w2_prompts,
        make_w4_prompts,
        w1_prompt_ids,
    )
