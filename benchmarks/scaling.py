"""Data-parallel scaling on one machine: W2's work (64 prompts, 128 tokens each, greedy, EOS ignored) sent as
streaming /v1/completions requests at client concurrency 64 (so every request is in flight at once, as in W2)
to (a) one `petrel serve` with all the cores, and (b) `petrel route` over N `petrel serve` processes that split
the cores between them (`--num-threads cores/N` each).

    python benchmarks/scaling.py [--replicas 2] [--num-prompts 64] [--out FILE.json]
"""

import argparse
import asyncio
import json
import os
import signal
import sys

from petrel.bench import make_w2_prompts
from petrel.bench.processes import free_port as _free_port
from petrel.bench.serve import run_client, start_server


def stop(procs) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)


def measure(name: str, servers: int, threads: int, prompts, max_tokens: int) -> dict:
    procs, urls = [], []
    try:
        for _ in range(servers):
            port = _free_port()
            procs.append(start_server(port, ["--num-threads", str(threads)]))
            urls.append(f"http://127.0.0.1:{port}")
        url = urls[0]
        if servers > 1:
            port = _free_port()
            procs.append(start_server(port, ["--backends", *urls], command="route", timeout=60))
            url = f"http://127.0.0.1:{port}"
        result = asyncio.run(run_client(url, None, prompts, max_tokens, concurrency=len(prompts)))
    finally:
        stop(procs)
    result.update(setup=name, servers=servers, threads_per_server=threads)
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cores = os.cpu_count() or 2
    prompts = make_w2_prompts()[: args.num_prompts]
    runs = [
        measure("one server", 1, cores, prompts, args.max_tokens),
        measure(
            f"router over {args.replicas}", args.replicas, max(1, cores // args.replicas), prompts, args.max_tokens
        ),
    ]
    ratio = runs[1]["output_tok_s"] / runs[0]["output_tok_s"]
    print(
        f"output tok/s: one server {runs[0]['output_tok_s']:.1f}, {args.replicas} data-parallel servers "
        f"{runs[1]['output_tok_s']:.1f} ({ratio:.2f}x)"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "ratio": ratio, "cores": cores}, f, indent=1)
    return 0 if all(r["valid"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
