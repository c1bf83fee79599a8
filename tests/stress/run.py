"""Stress runs against `petrel serve` started as a subprocess with its default limits (not part of pytest).

    PYTHONPATH=. python -m tests.stress.run [overload] [soak] [slowloris] [bombs] [grpc_lists] [lists] [slow_media]

overload: N concurrent streaming completions (default 500, max_tokens 8) from one loopback async httpx client.
    Reports accepted (200) / rejected (429) / other, p50/p99 time to first token of the accepted ones, the
    server process's peak RSS (psutil, sampled every 0.2 s) and /health latency sampled during the run.
soak: N requests (default 2,000, 64 at a time) where each one, at random, completes, streams and disconnects
    mid-stream, runs under a short client timeout, or is cancelled by the client task. Afterwards /metrics
    must show 0 requests running or waiting and 0 KV-cache usage.
slowloris: N connections (default 5,000, more than the default --max-connections of 4,096) from another process
    send half a request's headers and a header line every 2 s, reconnecting whenever the server closes them, for
    30 s. /health is probed meanwhile on a new connection and on a kept-alive one; its p99 must stay under 1 s,
    no slow connection may live longer than --header-timeout + 3 s, the server must log only a few lines, and
    its RSS must come back within 10% of what it was before.
bombs: one after another, a few requests each (4 at a time): huge prompts (10 MB of text, a 2M-token id list),
    grammar bombs (guided_choice of 100k strings, a JSON schema 400 levels deep or with 50k properties, a regex
    and a grammar that expand enormously), disaggregation abuse (generation_only fetching its KV from a port
    that never answers, from the server's own HTTP port, from a closed port; a flood of context_only requests).
    Each must be refused (4xx) within --bomb-deadline seconds, /health p99 must stay under 1 s meanwhile, and
    the RSS must come back within 10% afterwards.
grpc_lists: the server also serves gRPC (--grpc-port); attackers send Generate requests with huge lists (100,000
    bad strings, 100,000 stop strings, 300,000 stop token ids: each refused INVALID_ARGUMENT within --bomb-deadline)
    and 64 bad words of 60 kB (within the limits: served) beside a healthy gRPC client (HealthCheck, GetModelInfo,
    a 4-token Generate), whose latencies are reported alone and under the attack; HealthCheck and GetModelInfo
    p99 must stay under 1 s (tests/stress/grpc_lists.py).
lists: request lists past their limits, 4 at a time, 3 times each: 50,000 function tools (chat and Responses),
    200,000 messages, 200,000 Responses input items; each must be a 400 within --bomb-deadline seconds. Then 128
    tools of 100 properties each (within the limit: seconds of schema checks each, then refused for the prompt
    they make) must be refused within 120 s. /health p99 must stay under 1 s throughout, the RSS come back within
    10%.
slow_media: its own server, on a tiny random-weight vision model (built in a temporary directory) with
    --allow-private-media, and two local image hosts that answer 200 and then trickle one byte every 0.5 s.
    Two clients ask, over and over for --media-seconds, for chats with an image from one host each, while a
    third sends text-only chats one after another. Reports the text chats' latency before and during the
    attack (p50 / p99 / max) and how long the image requests took; the text chats' p99 must stay under 1 s and
    each image request must be answered by --media-fetch-timeout + 2 s.
Prints one JSON object with the figures; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque

import httpx
import psutil

from tests.stress.grpc_lists import available as grpc_available
from tests.stress.grpc_lists import grpc_lists, grpc_lists_failures

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fibonacci(n):",
    "The best way to learn a language is",
    "Q: What is 2 + 2?\nA:",
    "Dear Sir,",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, extra_args=()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "petrel.cli",
                "serve",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.ps = psutil.Process(self.proc.pid)
        self.log_lines, self.log_tail = 0, deque(maxlen=40)  # what the server wrote to stderr
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.5)
                raise RuntimeError("the server died: " + "".join(self.log_tail)[-3000:])
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def _read_log(self) -> None:
        """Drains the server's stderr (a full pipe would block it) counting the lines, keeping the last ones."""
        for line in iter(self.proc.stderr.readline, b""):
            self.log_lines += 1
            self.log_tail.append(line.decode(errors="replace"))

    def fds(self) -> int:
        try:
            return self.ps.num_fds()
        except psutil.Error:
            return 0

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
            except TimeoutError:
                pass


async def metrics(client: httpx.AsyncClient, base: str) -> dict:
    out = {}
    for line in (await client.get(f"{base}/metrics")).text.splitlines():
        for name in (
            "petrel_num_requests_running",
            "petrel_num_requests_waiting",
            "petrel_kv_cache_usage_perc",
            "petrel_request_rejected_total",
            "petrel_request_aborted_total",
        ):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def settle(client: httpx.AsyncClient, base: str, seconds: float = 60) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        m = await metrics(client, base)
        idle = (
            m.get("petrel_num_requests_running") == 0
            and m.get("petrel_num_requests_waiting") == 0
            and m.get("petrel_kv_cache_usage_perc") == 0
        )
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
    return {
        "requests": n,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 1),
        "statuses": statuses,
        "accepted": statuses.get("200", 0),
        "rejected_429": statuses.get("429", 0),
        "completed_with_done": sum(1 for r in results if r.get("done")),
        "ttft_p50_s": round(pct(ttfts, 50), 3) if ttfts else None,
        "ttft_p99_s": round(pct(ttfts, 99), 3) if ttfts else None,
        "server_peak_rss_mib": round(side["rss"] / 2**20),
        "health_samples": len(side["health"]),
        "health_ok": len(health),
        "health_p50_s": round(pct(health, 50), 3) if health else None,
        "health_max_s": round(max(health), 3) if health else None,
        "after": after,
    }


# ------------------------------------------------------------------------------------------------ fault soak


async def faulty_request(client, base, rng: random.Random, tally: dict) -> None:
    kind = rng.choice(["complete", "complete_stream", "disconnect", "timeout", "cancel"])
    body = {
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(2, 12),
        "ignore_eos": True,
        "stream": kind != "complete",
    }
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
                        return "disconnected"  # leaving the block closes the connection mid-stream
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
    except TimeoutError:
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
    return {
        "requests": n,
        "concurrency": concurrency,
        "wall_s": round(wall, 1),
        "outcomes": dict(sorted(tally.items())),
        "after": after,
        "settle_s": round(settle_s, 1),
        "next_request_status": ok,
        "server_peak_rss_mib": round(side["rss"] / 2**20),
        "health_max_s": round(max(health), 3) if health else None,
    }


# ------------------------------------------------------------------------------------------------ shared


async def probe_health(base: str, stop: asyncio.Event, fresh: bool, out: list) -> None:
    """/health every 0.2 s until `stop`, on a new connection each time (`fresh`: it must get past the connection
    cap) or on one kept alive; appends the latency, or None for a failure (an error or a status other than 200)."""
    limits = httpx.Limits(max_keepalive_connections=0 if fresh else 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, connect=10), limits=limits) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = (await client.get(f"{base}/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append(time.perf_counter() - t0 if ok else None)
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except TimeoutError:
                pass


async def watch_server(server: Server, stop: asyncio.Event, out: dict) -> None:
    """The server's peak RSS and open file descriptors every 0.2 s until `stop`."""
    while not stop.is_set():
        out["peak_rss"] = max(out.get("peak_rss", 0), server.rss())
        out["peak_fds"] = max(out.get("peak_fds", 0), server.fds())
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass


async def under_watch(server: Server, attack) -> tuple[object, dict]:
    """Runs the coroutine `attack` while /health is probed (fresh and kept-alive connections) and the server
    watched; returns its result and the figures."""
    stop, fresh, kept, peaks = asyncio.Event(), [], [], {}
    watchers = [
        asyncio.create_task(probe_health(server.base, stop, True, fresh)),
        asyncio.create_task(probe_health(server.base, stop, False, kept)),
        asyncio.create_task(watch_server(server, stop, peaks)),
    ]
    try:
        result = await attack
    finally:
        stop.set()
        await asyncio.gather(*watchers)
    return result, {
        **health_figures(fresh + kept),
        "health_fresh_connection": health_figures(fresh),
        "peak_rss_mib": round(peaks.get("peak_rss", 0) / 2**20),
        "peak_fds": peaks.get("peak_fds"),
    }


def health_figures(latencies: list) -> dict:
    """p50 / p99 / max of /health latency; a failed probe counts as slower than any answer (p99 is None when
    more than 1% failed)."""
    ranked = [lat if lat is not None else float("inf") for lat in latencies]

    def shown(v):
        return None if v is None or v == float("inf") else round(v, 3)

    return {
        "health_samples": len(latencies),
        "health_failed": sum(lat is None for lat in latencies),
        "health_p50_s": shown(pct(ranked, 50)),
        "health_p99_s": shown(pct(ranked, 99)),
        "health_max_s": shown(max(ranked)) if ranked else None,
    }


async def rss_recovery(server: Server, baseline: int, seconds: float = 30.0) -> dict:
    """Waits (up to `seconds`) for the server's RSS to come back within 10% of `baseline`."""
    t0 = time.monotonic()
    while True:
        rss = server.rss()
        if rss <= baseline * 1.10 or time.monotonic() - t0 > seconds:
            return {
                "rss_before_mib": round(baseline / 2**20),
                "rss_after_mib": round(rss / 2**20),
                "rss_after_vs_before": round(rss / baseline, 3),
                "rss_recovered": rss <= baseline * 1.10,
                "rss_recovery_s": round(time.monotonic() - t0, 1),
                "fds_after": server.fds(),
            }
        await asyncio.sleep(1.0)


async def warm_up(server: Server) -> int:
    """A request, so that the baseline RSS counts what serving one allocates; returns the RSS after it."""
    async with httpx.AsyncClient(timeout=120) as client:
        await client.post(f"{server.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    await asyncio.sleep(1.0)
    return server.rss()


# ------------------------------------------------------------------------------------------------ slowloris

SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: petrel\r\nContent-Type: application/json\r\n"


async def _until_closed(reader: asyncio.StreamReader) -> str:
    """How the server ended a slow connection: "http_408" (its answer's status), "closed" (no answer), "reset"."""
    try:
        data = await reader.read()
    except ConnectionError:
        return "reset"
    except OSError as exc:
        return type(exc).__name__
    return f"http_{data[9:12].decode(errors='replace')}" if data.startswith(b"HTTP/1.1 ") else "closed"


async def _slow_connection(port: int, start: float, deadline: float, trickle: float, stats: dict) -> None:
    """One attacker: half a request, then a header line every `trickle` s; reconnects when the server closes."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        except (TimeoutError, OSError) as exc:
            stats["outcomes"][f"connect_{type(exc).__name__}"] += 1
            await asyncio.sleep(0.2)
            continue
        opened = time.monotonic()
        stats["outcomes"]["opened"] += 1
        ended = asyncio.ensure_future(_until_closed(reader))
        writer.write(SLOW_HEAD)
        while not ended.done() and time.monotonic() < deadline:
            await asyncio.wait([ended], timeout=min(trickle, max(0.0, deadline - time.monotonic())))
            if not ended.done() and not writer.is_closing():
                writer.write(b"X-Slow: 1\r\n")
        held = time.monotonic() - opened
        if ended.done():
            stats["outcomes"][ended.result()] += 1
            stats["longest_held_s"] = max(stats["longest_held_s"], held)
        else:
            ended.cancel()
            stats["oldest_open_at_end_s"] = max(stats["oldest_open_at_end_s"], held)
        writer.close()


async def _slowloris_attack(port: int, connections: int, seconds: float, trickle: float, ramp: float) -> dict:
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # writes to sockets the server closed
    stats = {"outcomes": Counter(), "longest_held_s": 0.0, "oldest_open_at_end_s": 0.0}
    t0 = time.monotonic()
    await asyncio.gather(
        *(_slow_connection(port, t0 + ramp * i / connections, t0 + seconds, trickle, stats) for i in range(connections))
    )
    return {
        "outcomes": dict(stats["outcomes"]),
        "longest_held_s": round(stats["longest_held_s"], 2),
        "oldest_open_at_end_s": round(stats["oldest_open_at_end_s"], 2),
    }


def slowloris_process(port: int, connections: int, seconds: float, trickle: float, ramp: float, results) -> None:
    """The attack in a process of its own, so that its event loop does not delay the /health probes."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    results.put(asyncio.run(_slowloris_attack(port, connections, seconds, trickle, ramp)))


async def slowloris(server: Server, connections: int, seconds: float, trickle: float) -> dict:
    baseline, fds_before, log_before = await warm_up(server), server.fds(), server.log_lines
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    attacker = ctx.Process(
        target=slowloris_process,
        args=(server.port, connections, seconds, trickle, min(5.0, seconds / 4), results),
        daemon=True,
    )
    attacker.start()

    async def attack():
        while attacker.is_alive() and results.empty():
            await asyncio.sleep(0.2)
        return await asyncio.to_thread(results.get, timeout=120)

    t0 = time.perf_counter()
    outcome, figures = await under_watch(server, attack())
    wall = time.perf_counter() - t0
    attacker.join(30)
    recovery = await rss_recovery(server, baseline)
    return {
        "connections": connections,
        "attack_s": seconds,
        "trickle_s": trickle,
        "wall_s": round(wall, 1),
        **outcome,
        **figures,
        "fds_before": fds_before,
        **recovery,
        "server_log_lines": server.log_lines - log_before,
        "server_log_tail": list(server.log_tail)[-5:],
    }


# ------------------------------------------------------------------------------------------------ bombs


def _bomb_requests(server_port: int, tarpit_port: int, closed_port: int) -> dict[str, list[tuple[str, str, bytes]]]:
    """Each bomb: (label, path, JSON body) requests."""

    def body(**fields) -> bytes:
        return json.dumps(fields).encode()

    huge_text = "lorem ipsum " * (10 * 2**20 // 12)  # 10 MB
    grammar_rules = "\n".join(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(20_000)) + '\nr20000 ::= "c"'
    deep_schema: dict = {"type": "string"}
    for _ in range(400):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}, "required": ["a"]}
    wide_schema = {
        "type": "object",
        "properties": {f"field_{i}": {"type": "integer"} for i in range(50_000)},
        "required": [f"field_{i}" for i in range(50_000)],
    }

    def generation_only(endpoint: str) -> bytes:
        return body(
            prompt="hi",
            max_tokens=4,
            disaggregated_params={
                "request_type": "generation_only",
                "first_gen_tokens": [42],
                "ctx_request_id": 1,
                "opaque_state": "0" * 64,
                "ctx_info_endpoint": endpoint,
            },
        )

    completions, chat = "/v1/completions", "/v1/chat/completions"
    return {
        "huge_prompt": [
            ("completion_10MB_text", completions, body(prompt=huge_text, max_tokens=1)),
            ("chat_10MB_message", chat, body(messages=[{"role": "user", "content": huge_text}], max_tokens=1)),
            ("completion_2M_token_ids", completions, body(prompt=[42] * 2_000_000, max_tokens=1)),
        ],
        "grammar_bomb": [
            (
                "guided_choice_100k",
                completions,
                body(prompt="hi", max_tokens=4, guided_choice=[f"choice number {i:06d}" for i in range(100_000)]),
            ),
            ("guided_json_400_deep", completions, body(prompt="hi", max_tokens=4, guided_json=deep_schema)),
            ("guided_json_50k_properties", completions, body(prompt="hi", max_tokens=4, guided_json=wide_schema)),
            (
                "guided_regex_repeat_bomb",
                completions,
                body(prompt="hi", max_tokens=4, guided_regex="((a|b){1,1000}){1,1000}c{1,100000}"),
            ),
            (
                "guided_grammar_20k_rules",
                completions,
                body(prompt="hi", max_tokens=4, guided_grammar="root ::= r0\n" + grammar_rules),
            ),
        ],
        "disagg_abuse": [
            ("generation_only_from_tarpit", completions, generation_only(f"127.0.0.1:{tarpit_port}")),
            ("generation_only_from_own_http_port", completions, generation_only(f"127.0.0.1:{server_port}")),
            ("generation_only_from_closed_port", completions, generation_only(f"127.0.0.1:{closed_port}")),
            (
                "context_only_flood",
                completions,
                body(
                    prompt="Tell me a story. " * 50, max_tokens=1, disaggregated_params={"request_type": "context_only"}
                ),
            ),
        ],
    }


async def _tarpit() -> tuple[asyncio.AbstractServer, int]:
    """A TCP listener that accepts and never answers (a KV transfer server that hangs)."""
    held = []

    async def hold(reader, writer):
        held.append(writer)
        await asyncio.sleep(3600)

    srv = await asyncio.start_server(hold, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _send_bomb(client, base, label, path, payload, deadline: float) -> dict:
    t0 = time.perf_counter()
    try:
        r = await client.post(
            f"{base}{path}",
            content=payload,
            headers={"content-type": "application/json"},
            timeout=max(60.0, deadline * 4),
        )
        status, code, message = r.status_code, None, None
        try:
            error = r.json().get("error") or {}
            code, message = error.get("code"), str(error.get("message"))[:160]
        except (ValueError, AttributeError):
            pass
    except httpx.HTTPError as exc:
        status, code, message = type(exc).__name__, None, str(exc)[:160]
    return {"label": label, "status": status, "code": code, "message": message, "seconds": time.perf_counter() - t0}


async def bomb(server: Server, requests: list, repeat: int, concurrency: int, deadline: float) -> dict:
    """`requests` sent `repeat` times each, `concurrency` at a time, while /health is probed."""
    baseline = await warm_up(server)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)

    async def attack():
        async with httpx.AsyncClient(limits=limits) as client:

            async def one(req):
                async with sem:
                    return await _send_bomb(client, server.base, *req, deadline)

            return await asyncio.gather(*(one(req) for req in requests * repeat))

    t0 = time.perf_counter()
    results, figures = await under_watch(server, attack())
    wall = time.perf_counter() - t0
    async with httpx.AsyncClient(timeout=60) as client:
        after = await settle(client, server.base, seconds=90)
    recovery = await rss_recovery(server, baseline)
    by_label = {}
    for r in results:
        entry = by_label.setdefault(
            r["label"], {"statuses": Counter(), "codes": Counter(), "max_s": 0.0, "message": r["message"]}
        )
        entry["statuses"][str(r["status"])] += 1
        entry["codes"][str(r["code"])] += 1
        entry["max_s"] = round(max(entry["max_s"], r["seconds"]), 3)
    refused_fast = [
        isinstance(r["status"], int) and 400 <= r["status"] < 500 and r["seconds"] < deadline for r in results
    ]
    return {
        "requests": len(results),
        "wall_s": round(wall, 1),
        "all_refused_fast": all(refused_fast),
        "refused_fast": sum(refused_fast),
        "by_request": {
            k: {**v, "statuses": dict(v["statuses"]), "codes": dict(v["codes"])} for k, v in by_label.items()
        },
        **figures,
        **recovery,
        "after": after,
    }


async def bombs(server: Server, repeat: int, concurrency: int, deadline: float, flood: int) -> dict:
    tarpit, tarpit_port = await _tarpit()
    closed_port = free_port()
    out = {}
    try:
        for name, requests in _bomb_requests(server.port, tarpit_port, closed_port).items():
            if name == "disagg_abuse":  # the flood: many context_only requests, each pinning its prompt's KV
                flood_req = requests[-1]
                requests = requests[:-1] + [flood_req] * max(1, flood // repeat)
            out[name] = await bomb(server, requests, repeat, concurrency, deadline)
            print(json.dumps({f"bombs.{name}": out[name]}), flush=True)
    finally:
        tarpit.close()
    return out


# ------------------------------------------------------------------------------------------------ lists


def _list_bombs() -> dict[str, list[tuple[str, str, bytes]]]:
    """Each group: (label, path, JSON body) requests. huge_lists are past their limits (refused on the count);
    tools_within_limit are at the limit with big schemas (checked off the event loop, then too long a prompt)."""

    def body(**fields) -> bytes:
        return json.dumps(fields).encode()

    def tool(parameters) -> dict:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    user, chat, responses = [{"role": "user", "content": "Hi"}], "/v1/chat/completions", "/v1/responses"
    flat_tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "a field"} for i in range(100)}}
    return {
        "huge_lists": [
            ("chat_50k_tools", chat, body(messages=user, max_tokens=2, tools=[tool({"type": "object"})] * 50_000)),
            ("responses_50k_tools", responses, body(input="Hi", tools=[flat_tool] * 50_000)),
            ("chat_200k_messages", chat, body(messages=user * 200_000, max_tokens=2)),
            ("responses_200k_input_items", responses, body(input=user * 200_000)),
        ],
        "tools_within_limit": [
            ("chat_128_tools_of_100_properties", chat, body(messages=user, max_tokens=2, tools=[tool(big)] * 128))
        ],
    }


TOOLS_WITHIN_LIMIT_DEADLINE = 120.0  # seconds: 4 requests of seconds of schema checks share the schema pool


async def lists(server: Server, repeat: int, concurrency: int, deadline: float) -> dict:
    out = {}
    for name, requests in _list_bombs().items():
        limit = deadline if name == "huge_lists" else TOOLS_WITHIN_LIMIT_DEADLINE
        out[name] = {**await bomb(server, requests, repeat, concurrency, limit), "deadline_s": limit}
        print(json.dumps({f"lists.{name}": out[name]}), flush=True)
    return out


# ------------------------------------------------------------------------------------------------ slow media


async def _trickle_host() -> tuple[asyncio.AbstractServer, int]:
    """An image host that answers 200, then sends one byte every 0.5 s until the fetcher hangs up."""

    async def serve(reader, writer):
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n\r\n")
            while True:
                writer.write(b"\x89")
                await writer.drain()
                await asyncio.sleep(0.5)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass  # the fetcher hung up, or the run is over
        finally:
            writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _timed_chat(client, base: str, content) -> tuple[float, object]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    t0 = time.perf_counter()
    try:
        status = (await client.post(f"{base}/v1/chat/completions", json=body)).status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return time.perf_counter() - t0, status


def _latencies(samples: list) -> dict:
    ok = [lat for lat, status in samples if status == 200]
    return {
        "samples": len(samples),
        "failed": len(samples) - len(ok),
        "p50_s": round(pct(ok, 50), 3) if ok else None,
        "p99_s": round(pct(ok, 99), 3) if ok else None,
        "max_s": round(max(ok), 3) if ok else None,
    }


async def slow_media(server_args: list, seconds: float, fetch_timeout: float) -> dict:
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: the tiny models
    from tiny_vlm import build_tiny_idefics3

    with tempfile.TemporaryDirectory(prefix="petrel-stress-vlm-") as path:
        build_tiny_idefics3(path)
        server = Server(
            ["--model", path, "--allow-private-media", "--media-fetch-timeout", str(fetch_timeout), *server_args]
        )
        hosts = [await _trickle_host() for _ in range(2)]
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(fetch_timeout * 4 + 30)) as client:
                before = [await _timed_chat(client, server.base, "Hello") for _ in range(10)]
                stop, images, during = asyncio.Event(), [], []

                async def attacker(port: int):
                    url = f"http://127.0.0.1:{port}/cat.png"
                    while not stop.is_set():
                        images.append(await _timed_chat(client, server.base, [
                            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}
                        ]))  # fmt: skip

                attackers = [asyncio.create_task(attacker(port)) for _, port in hosts]
                await asyncio.sleep(1.0)  # both image requests under way
                t_end = time.monotonic() + seconds
                while time.monotonic() < t_end:
                    during.append(await _timed_chat(client, server.base, "Hello"))
                    await asyncio.sleep(0.2)
                stop.set()
                await asyncio.gather(*attackers)
        finally:
            for srv, _ in hosts:
                srv.close()
            exit_code = server.stop()
    statuses = Counter(str(status) for _, status in images)
    return {
        "seconds": seconds,
        "media_fetch_timeout_s": fetch_timeout,
        "text_chat_before": _latencies(before),
        "text_chat_during": _latencies(during),
        "image_requests": len(images),
        "image_statuses": dict(statuses),
        "image_max_s": round(max(lat for lat, _ in images), 2) if images else None,
        "server_exit_code": exit_code,
    }


def slow_media_failures(r: dict) -> list[str]:
    failures, during = [], r["text_chat_during"]
    if during["failed"] or during["p99_s"] is None or during["p99_s"] >= 1.0:
        failures.append(f"slow_media: text chat p99 {during['p99_s']} s beside slow image hosts ({during})")
    if r["image_max_s"] is None or r["image_max_s"] > r["media_fetch_timeout_s"] + 2.0:
        failures.append(f"slow_media: an image request took {r['image_max_s']} s")
    if set(r["image_statuses"]) - {"400"}:
        failures.append(f"slow_media: image requests answered {r['image_statuses']} (400 expected)")
    return failures


def slowloris_failures(r: dict, header_timeout: float) -> list[str]:
    failures = []
    if r["health_p99_s"] is None or r["health_p99_s"] >= 1.0:
        failures.append(f"slowloris: /health p99 {r['health_p99_s']} s (>= 1 s or over 1% failed)")
    held = max(r["longest_held_s"], r["oldest_open_at_end_s"])
    if held > header_timeout + 3.0:
        failures.append(f"slowloris: a slow connection stayed open {held} s (header timeout {header_timeout} s)")
    if not r["rss_recovered"]:
        failures.append(f"slowloris: RSS {r['rss_after_mib']} MiB after vs {r['rss_before_mib']} MiB before")
    if r["server_log_lines"] > 100:
        failures.append(f"slowloris: the server logged {r['server_log_lines']} lines")
    return failures


def bombs_failures(report: dict, deadline: float, run: str = "bombs") -> list[str]:
    failures, four_xx = [], {str(s) for s in range(400, 500)}
    for group, r in report.items():
        name, limit = f"{run}.{group}", r.get("deadline_s", deadline)  # a group may have a deadline of its own
        if not r["all_refused_fast"]:
            missed = {
                label: [v["statuses"], v["max_s"]]
                for label, v in r["by_request"].items()
                if set(v["statuses"]) - four_xx or v["max_s"] >= limit
            }
            failures.append(
                f"{name}: {r['requests'] - r['refused_fast']} of {r['requests']} requests not "
                f"refused with a 4xx within {limit} s: {json.dumps(missed)}"
            )
        if r["health_p99_s"] is None or r["health_p99_s"] >= 1.0:
            failures.append(f"{name}: /health p99 {r['health_p99_s']} s (>= 1 s or over 1% failed)")
        if not r["rss_recovered"]:
            failures.append(f"{name}: RSS {r['rss_after_mib']} MiB after vs {r['rss_before_mib']} MiB before")
    return failures


RUNS = ("overload", "soak", "slowloris", "bombs", "grpc_lists", "lists", "slow_media")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help=f"any of {', '.join(RUNS)} (default: all)")
    p.add_argument("--requests", type=int, default=500, help="overload: concurrent streams")
    p.add_argument("--max-tokens", type=int, default=8, help="overload: tokens per stream")
    p.add_argument("--soak-requests", type=int, default=2000)
    p.add_argument("--soak-concurrency", type=int, default=64)
    p.add_argument("--slow-connections", type=int, default=5000, help="slowloris: attacking connections")
    p.add_argument("--slow-seconds", type=float, default=30.0, help="slowloris: how long the attack lasts")
    p.add_argument("--slow-trickle", type=float, default=2.0, help="slowloris: seconds between header lines")
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="slowloris: the server's --header-timeout (the check allows 3 s more)",
    )
    p.add_argument("--bomb-repeat", type=int, default=3, help="bombs: times each request is sent")
    p.add_argument("--bomb-concurrency", type=int, default=4, help="bombs: requests at once")
    p.add_argument("--bomb-deadline", type=float, default=2.0, help="bombs: seconds a refusal may take")
    p.add_argument("--context-only-flood", type=int, default=200, help="bombs: context_only requests sent")
    p.add_argument("--grpc-seconds", type=float, default=30.0, help="grpc_lists: how long the attack lasts")
    p.add_argument("--grpc-attackers", type=int, default=2, help="grpc_lists: attacking processes")
    p.add_argument("--media-seconds", type=float, default=20.0, help="slow_media: how long the attack lasts")
    p.add_argument(
        "--media-fetch-timeout", type=float, default=10.0, help="slow_media: the server's --media-fetch-timeout"
    )
    p.add_argument("--server-arg", action="append", default=[], help="passed to `petrel serve` (repeatable)")
    args = p.parse_args(argv)
    args.runs = args.runs or [run for run in RUNS if run != "grpc_lists" or grpc_available()]
    if set(args.runs) - set(RUNS):
        p.error(f"unknown run(s): {sorted(set(args.runs) - set(RUNS))}")
    grpc_port = free_port() if "grpc_lists" in args.runs else None
    own_server = set(args.runs) - {"slow_media"}  # slow_media starts its own
    server_args = args.server_arg + ([] if grpc_port is None else ["--grpc-port", str(grpc_port)])
    server = Server(server_args) if own_server else None
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
            if not (
                a.get("petrel_num_requests_running") == 0
                and a.get("petrel_num_requests_waiting") == 0
                and a.get("petrel_kv_cache_usage_perc") == 0
            ):
                failures.append(f"soak: the engine is not empty afterwards: {a}")
            if s["next_request_status"] != 200:
                failures.append("soak: the server did not serve a request afterwards")
        if "slowloris" in args.runs:
            sl = report["slowloris"] = asyncio.run(
                slowloris(server, args.slow_connections, args.slow_seconds, args.slow_trickle)
            )
            print(json.dumps({"slowloris": sl}), flush=True)
            failures += slowloris_failures(sl, args.header_timeout)
        if "bombs" in args.runs:
            b = report["bombs"] = asyncio.run(
                bombs(server, args.bomb_repeat, args.bomb_concurrency, args.bomb_deadline, args.context_only_flood)
            )
            failures += bombs_failures(b, args.bomb_deadline)
        if "grpc_lists" in args.runs:
            g = report["grpc_lists"] = grpc_lists(grpc_port, args.grpc_seconds, args.grpc_attackers, pct)
            print(json.dumps({"grpc_lists": g}), flush=True)
            failures += grpc_lists_failures(g, args.bomb_deadline)
        if "lists" in args.runs:
            li = report["lists"] = asyncio.run(
                lists(server, args.bomb_repeat, args.bomb_concurrency, args.bomb_deadline)
            )
            failures += bombs_failures(li, args.bomb_deadline, "lists")
        if "slow_media" in args.runs:
            m = report["slow_media"] = asyncio.run(
                slow_media(args.server_arg, args.media_seconds, args.media_fetch_timeout)
            )
            print(json.dumps({"slow_media": m}), flush=True)
            failures += slow_media_failures(m)
    finally:
        if server is not None:
            report["server_exit_code"] = server.stop()
    report["failures"] = failures
    print(json.dumps(report, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
