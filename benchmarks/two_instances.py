"""Two `petrel serve` instances on one shared KV store: the second serves prefixes the first computed.

    redis-server --port 6399 --save '' --daemonize yes
    python benchmarks/two_instances.py --kv-store-url redis://127.0.0.1:6399/0 --out two_instances.json

Instance A (with the store) receives one request per shared prefix and computes it, publishing its KV blocks.
Then instance B (the same store) and instance C (no store: recomputation) receive the same prefixes with new
suffixes, alternating B and C request by request so both see the same machine. Reported: TTFT (send to the first
streamed token, one request at a time) on B and C, p50 and mean, and B's prompt tokens served from the store.
Prompts are token ids (W5's generator), so no tokenizer difference enters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import httpx

from petrel.bench.serve import start_server
from petrel.bench.workloads import W5Sizes, make_w5_prompts


def ttft(port: int, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt tokens the server took from its cache."""
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens", cached) or cached
    return first, cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-store-url", required=True)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--port", type=int, default=8601, help="A's port; B and C take the next two")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = W5Sizes(
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        requests_per_prefix=2,
        suffix_len=args.suffix_len,
        new_tokens=1,
        cache_prefixes=args.num_prefixes,
        concurrency=1,
    )
    by_prefix: dict[int, list[list[int]]] = {}
    for index, prompt in make_w5_prompts(sizes):
        by_prefix.setdefault(index, []).append(prompt)
    extra = ["--max-model-len", str(args.prefix_len + args.suffix_len + 64)]
    a = start_server(args.port, [*extra, "--kv-store-url", args.kv_store_url])
    try:
        for prompts in by_prefix.values():
            ttft(args.port, prompts[0])
        time.sleep(2)  # the store's puts are asynchronous
    finally:
        a.terminate()
        a.wait(30)
    b = start_server(args.port + 1, [*extra, "--kv-store-url", args.kv_store_url])
    c = start_server(args.port + 2, extra)
    rows = []
    try:
        for prompts in by_prefix.values():
            tb, cached_b = ttft(args.port + 1, prompts[1])
            tc, cached_c = ttft(args.port + 2, prompts[1])
            rows.append({"store_s": tb, "recompute_s": tc, "store_cached": cached_b, "recompute_cached": cached_c})
    finally:
        for p in (b, c):
            p.terminate()
            p.wait(30)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "prompt_tokens": args.prefix_len + args.suffix_len,
        "store_ttft_p50_s": statistics.median(r["store_s"] for r in rows),
        "recompute_ttft_p50_s": statistics.median(r["recompute_s"] for r in rows),
        "store_ttft_mean_s": statistics.mean(r["store_s"] for r in rows),
        "recompute_ttft_mean_s": statistics.mean(r["recompute_s"] for r in rows),
        "rows": rows,
        "cpus": os.cpu_count(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
