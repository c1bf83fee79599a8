"""Stress runs against `petrel serve` started as a subprocess with its default limits (not part of pytest).

    PYTHONPATH=. python -m tests.stress.run [overload] [soak] [--requests N] [--soak-requests N]

overload: N concurrent streaming completions (default 500, max_tokens 8) from one loopback async httpx client.
    Reports accepted (200) / rejected (429) / other, p50/p99 time to first token of the accepted ones, the
    server process's peak RSS (psutil, sampled every 0.2 s) and /health latency sampled during the run.
soak: N requests (default 2,000, 64 at a time) where each one, at random, completes, streams and disconnects
    mid-stream, runs under a short client timeout, or is cancelled by the client task. Afterwards /metrics
    must show 0 requests running or waiting and 0 KV-cache usage.
Prints one JSON object with the figures; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psutil

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,", "Once upon a time",
           "def fibonacci(n):", "The best way to learn a language is", "Q: What is 2 + 2?\nA:", "Dear Sir,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, extra_args=()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "petrel.cli", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *extra_args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the server died: " + self.proc.stderr.read().decode()[-3000:])
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def rss(self) -> int:
        try:
            return self.ps.memory_info().rss
        except psutil.Error:
            return 0

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def sample(server: Server, stop: asyncio.Event, out: dict) -> None:
    """/health latency and the server's RSS, every 0.2 s until `stop`."""
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = await client.get(f"{server.base}/health")
                out["health"].append((time.perf_counter() - t0, r.status_code))
            except httpx.HTTPError as exc:
                out["health"].append((time.perf_counter() - t0, type(exc).__name__))
            out["rss"] = max(out["rss"], server.rss())
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except asyncio.TimeoutError:
                pass


async def metrics(client: httpx.AsyncClient, base: str) -> dict:
    out = {}
    for line in (await client.get(f"{base}/metrics")).text.splitlines():
        for name in ("petrel_num_requests_running", "petrel_num_requests_waiting", "petrel_kv_cache_usage_perc",
                     "petrel_request_rejected_total", "petrel_request_aborted_total"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def settle(client: httpx.AsyncClient, base: str, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        m = await metrics(client, base)
        idle = (m.get("petrel_num_requests_running") == 0 and m.get("petrel_num_requests_waiting") == 0
                and m.get("petrel_kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------------------ overload

async def one_stream(client, base, i, max_tokens, results) -> None:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                results.append({"status": r.status_code})
                return
            ttft, done, events = None, False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    results.append({"status": "stream_error", "error": event["error"]["message"]})
                    return
                if ttft is None and event["choices"] and event["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
                events += 1
            results.append({"status": 200, "ttft": ttft, "done": done, "e2e": time.perf_counter() - t0})
    except httpx.HTTPError as exc:
        results.append({"status": type(exc).__name__})


async def overload(server: Server, n: int, max_tokens: int) -> dict:
    results, side = [], {"health": [], "rss": server.rss()}
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        sampler = asyncio.create_task(sample(server, stop, side))
        t0 = time.perf_counter()
        await asyncio.gather(*(one_stream(client, server.base, i, max_tokens, results) for i in range(n)))
        wall = time.perf_counter() - t0
        stop.set()
        await sampler
        after = await settle(client, server.base)
    statuses = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    health = [lat for lat, status in side["health"] if status == 200]
    return {"requests": n, "max_tokens": max_tokens, "wall_s": round(wall, 1), "statuses": statuses,
            "accepted": statuses.get("200", 0), "rejected_429": statuses.get("429", 0),
            "completed_with_done": sum(1 for r in results if r.get("done")),
            "ttft_p50_s": round(pct(ttfts, 50), 3) if ttfts else None,
            "ttft_p99_s": round(pct(ttfts, 99), 3) if ttfts else None,
            "server_peak_rss_mib": round(side["rss"] / 2**20),
            "health_samples": len(side["health"]), "health_ok": len(health),
            "health_p50_s": round(pct(health, 50), 3) if health else None,
            "health_max_s": round(max(health), 3) if health else None,
            "after": after}


# ------------------------------------------------------------------------------------------------ fault soak

async def faulty_request(client, base, rng: random.Random, tally: dict) -> None:
    kind = rng.choice(["complete", "complete_stream", "disconnect", "timeout", "cancel"])
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(2, 12), "ignore_eos": True,
            "stream": kind != "complete"}
    url = f"{base}/v1/completions"

    async def stream(read_events: int | None):
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if read_events is not None and seen >= read_events:
                        return "disconnected"          # leaving the block closes the connection mid-stream
            return 200

    try:
        if kind == "complete":
            r = await client.post(url, json=body)
            outcome = r.status_code
        elif kind == "complete_stream":
            outcome = await stream(None)
        elif kind == "disconnect":
            outcome = await stream(rng.randint(1, 3))
        elif kind == "timeout":
            outcome = await asyncio.wait_for(stream(None), rng.uniform(0.01, 0.5))
        else:
            task = asyncio.create_task(stream(None))
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            task.cancel()
            try:
                outcome = await task
            except asyncio.CancelledError:
                outcome = "cancelled"
    except asyncio.TimeoutError:
        outcome = "timed_out"
    except httpx.HTTPError as exc:
        outcome = type(exc).__name__
    key = f"{kind}:{outcome}"
    tally[key] = tally.get(key, 0) + 1


async def soak(server: Server, n: int, concurrency: int, seed: int = 0) -> dict:
    rng, tally = random.Random(seed), {}
    sem = asyncio.Semaphore(concurrency)
    side = {"health": [], "rss": server.rss()}
    stop = asyncio.Event()

    async def guarded(i):
        async with sem:
            await faulty_request(client, server.base, random.Random(rng.random()), tally)

    limits = httpx.Limits(max_connections=concurrency + 10)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=30), limits=limits) as client:
        sampler = asyncio.create_task(sample(server, stop, side))
        t0 = time.perf_counter()
        await asyncio.gather(*(guarded(i) for i in range(n)))
        wall = time.perf_counter() - t0
        stop.set()
        await sampler
        t1 = time.perf_counter()
        after = await settle(client, server.base)
        settle_s = time.perf_counter() - t1
        ok = (await client.post(f"{server.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code
    health = [lat for lat, status in side["health"] if status == 200]
    return {"requests": n, "concurrency": concurrency, "wall_s": round(wall, 1), "outcomes": dict(sorted(tally.items())),
            "after": after, "settle_s": round(settle_s, 1), "next_request_status": ok,
            "server_peak_rss_mib": round(side["rss"] / 2**20),
            "health_max_s": round(max(health), 3) if health else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="overload and/or soak (default: both)")
    p.add_argument("--requests", type=int, default=500, help="overload: concurrent streams")
    p.add_argument("--max-tokens", type=int, default=8, help="overload: tokens per stream")
    p.add_argument("--soak-requests", type=int, default=2000)
    p.add_argument("--soak-concurrency", type=int, default=64)
    p.add_argument("--server-arg", action="append", default=[], help="passed to `petrel serve` (repeatable)")
    args = p.parse_args(argv)
    args.runs = args.runs or ["overload", "soak"]
    if set(args.runs) - {"overload", "soak"}:
        p.error(f"unknown run(s): {sorted(set(args.runs) - {'overload', 'soak'})}")
    server = Server(args.server_arg)
    report, failures = {}, []
    try:
        if "overload" in args.runs:
            o = report["overload"] = asyncio.run(overload(server, args.requests, args.max_tokens))
            print(json.dumps({"overload": o}), flush=True)
            if any(k not in ("200", "429") for k in o["statuses"]):
                failures.append(f"overload: statuses other than 200/429: {o['statuses']}")
            if o["health_max_s"] is None or o["health_max_s"] >= 1.0 or o["health_ok"] != o["health_samples"]:
                failures.append("overload: /health slower than 1 s or failing")
            if o["completed_with_done"] != o["accepted"]:
                failures.append("overload: an accepted stream did not end with [DONE]")
        if "soak" in args.runs:
            s = report["soak"] = asyncio.run(soak(server, args.soak_requests, args.soak_concurrency))
            print(json.dumps({"soak": s}), flush=True)
            a = s["after"]
            if not (a.get("petrel_num_requests_running") == 0 and a.get("petrel_num_requests_waiting") == 0
                    and a.get("petrel_kv_cache_usage_perc") == 0):
                failures.append(f"soak: the engine is not empty afterwards: {a}")
            if s["next_request_status"] != 200:
                failures.append("soak: the server did not serve a request afterwards")
    finally:
        report["server_exit_code"] = server.stop()
    report["failures"] = failures
    print(json.dumps(report, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
