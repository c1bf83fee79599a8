"""`petrel bench serve`: W3 (online serving) against any OpenAI-compatible server.

    petrel bench serve                                   # starts `petrel serve` on 127.0.0.1, runs W3, stops it
    petrel bench serve --url http://127.0.0.1:8000 --model NAME      # a server already running (petrel or a peer)
    petrel bench serve --sweep 1,4,16,64 --plot serve.png --json serve.json   # one run per concurrency, plotted
    petrel bench serve --quick                           # 8 short requests: a smoke test

The W2 prompts (64 token-id prompts from numpy default_rng(0)) as streaming /v1/completions requests,
max_tokens 128, EOS ignored, greedy, usage in the last chunk, at a client concurrency of 16 (or each level of
--sweep); one warm-up request first (not timed). Per request: TTFT = first chunk carrying text - send time;
TPOT = (last chunk - first chunk) / (completion tokens - 1). Output tok/s = all completion tokens / wall time.
A figure is valid only if every request reports exactly max_tokens completion tokens.
The server runs in its own process, so the client's event loop does not share the GIL with the engine.
--plot (needs matplotlib) draws output tok/s and TTFT / TPOT (p50, p99) against concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import httpx

from petrel.bench.processes import free_port
from petrel.bench.report import percentile, plot_sweep
from petrel.bench.workloads import W3_CONCURRENCY, W3_NEW_TOKENS, make_w2_prompts


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: when it was sent, when its first and last text arrived, the tokens it reported."""
    t_send = time.perf_counter()
    t_first = t_last = None
    tokens = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            now = time.perf_counter()
            obj = json.loads(data)
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            if any(c.get("text") for c in obj.get("choices") or []):
                t_first = t_first or now
                t_last = now
    return {"t_send": t_send, "t_first": t_first, "t_last": t_last, "tokens": tokens}


async def run_client(
    base_url: str,
    model: str | None,
    prompts: list[list[int]] | list[str],
    max_tokens: int,
    concurrency: int,
    timeout: float = 600.0,
    prompt_tokens: int | None = None,
) -> dict:
    """W3 at one client concurrency against `base_url`: the run's figures, valid only if every count is right.
    prompts: token ids, or text (for servers that take no token ids, e.g. the smg gateway), with prompt_tokens
    then the ids' count for total_tok_s."""
    url = f"{base_url}/v1/completions"

    def body(prompt, n):
        b = {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        if model:
            b["model"] = model
        return b

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        await one_request(client, url, body(prompts[0][:32], 4))  # warm-up, not timed
        sem = asyncio.Semaphore(concurrency)

        async def guarded(p):
            async with sem:
                return await one_request(client, url, body(p, max_tokens))

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - t0
    counts = [r["tokens"] for r in results]
    bad = [(i, c) for i, c in enumerate(counts) if c != max_tokens]
    ttft = [r["t_first"] - r["t_send"] for r in results if r["t_first"] is not None]
    tpot = [(r["t_last"] - r["t_first"]) / (r["tokens"] - 1) for r in results if r["tokens"] and r["tokens"] > 1]
    out_tokens = sum(c or 0 for c in counts)
    prompt_tokens = sum(len(p) for p in prompts) if prompt_tokens is None else prompt_tokens
    return {
        "workload": "w3",
        "requests": len(results),
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "valid": not bad,
        "problems": [f"{len(bad)} requests did not report {max_tokens} tokens: {bad[:5]}"] if bad else [],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + prompt_tokens) / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "e2e_p50_s": percentile([r["t_last"] - r["t_send"] for r in results if r["t_last"]], 50),
    }


def start_server(port: int, extra_args: list[str], command: str = "serve", timeout: float = 300) -> subprocess.Popen:
    """`petrel serve` (or another petrel command serving /health, e.g. "route") on 127.0.0.1:port, once healthy."""
    cmd = [
        sys.executable,
        "-m",
        "petrel.cli",
        command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra_args,
    ]
    print(f"[w3] starting: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"petrel {command} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"petrel {command} did not become healthy in {timeout:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="petrel bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default=None, help="a server already running (default: start `petrel serve`)")
    ap.add_argument("--model", default=None, help="the model name to send (default: none, the server's only model)")
    ap.add_argument("--concurrency", type=int, default=W3_CONCURRENCY)
    ap.add_argument("--sweep", default=None, metavar="N,N,...", help="run once per client concurrency level")
    ap.add_argument("--num-prompts", type=int, default=None, help="use the first N W2 prompts (default 64)")
    ap.add_argument("--max-tokens", type=int, default=None, help=f"tokens per request (default {W3_NEW_TOKENS})")
    ap.add_argument("--quick", action="store_true", help="8 requests of 16 tokens, prompts cut to 128 tokens")
    ap.add_argument(
        "--text-prompts",
        action="store_true",
        help="send the prompts as text (decoded with the default model's tokenizer) for servers that take no token "
        "ids, such as the smg gateway; each server tokenizes them again",
    )
    ap.add_argument("--json", "--out", dest="out", default=None, metavar="FILE.json", help="write the results")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="plot the run(s) (needs matplotlib)")
    ap.add_argument("server_args", nargs="*", help="after --: options for `petrel serve` (e.g. -- --dtype bfloat16)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """`petrel bench serve [options]`: 0 when every run's figures count, 1 otherwise."""
    args = build_parser().parse_args(argv)
    try:
        levels = [int(x) for x in args.sweep.split(",")] if args.sweep else [args.concurrency]
    except ValueError:
        raise SystemExit(f"--sweep takes comma-separated integers, got {args.sweep!r}") from None
    if any(n < 1 for n in levels):
        raise SystemExit("concurrency levels must be >= 1")
    prompts = make_w2_prompts(8, 128) if args.quick else make_w2_prompts()
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    max_tokens = args.max_tokens or (16 if args.quick else W3_NEW_TOKENS)
    prompt_tokens = sum(map(len, prompts))
    if args.text_prompts:
        from petrel.model.loader import resolve_model
        from petrel.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(None))
        prompts = [tokenizer.decode(p) for p in prompts]
    proc = None
    url = args.url
    results = []
    try:
        if url is None:
            port = free_port()
            proc = start_server(port, args.server_args)
            url = f"http://127.0.0.1:{port}"
        for level in levels:
            result = asyncio.run(run_client(url, args.model, prompts, max_tokens, level, prompt_tokens=prompt_tokens))
            result.update(
                {
                    "engine": "petrel serve" if args.url is None else args.url,
                    "server_args": args.server_args,
                    "python": platform.python_version(),
                    "machine": platform.machine(),
                    "cpus": os.cpu_count(),
                }
            )
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results[0] if len(results) == 1 else {"sweep": results}, f, indent=2)
    if args.plot:
        plot_sweep(results, args.plot)
    return 0 if all(r["valid"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
