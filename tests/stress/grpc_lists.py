"""The grpc_lists stress run (tests/stress/run.py): gRPC clients sending huge lists beside a healthy gRPC client.

Attackers (processes of their own) send, one after another until the time is up, trtllm Generate requests with
100,000 `bad` strings, 100,000 stop strings, 300,000 stop token ids (each must be refused INVALID_ARGUMENT within
the deadline) and 64 bad words of 60 kB each (within the limits: seconds of tokenizing, then served). Meanwhile a
healthy client calls HealthCheck, GetModelInfo and a small Generate (4 tokens) in a loop; its latencies are
reported for a baseline (alone, before the attack) and under the attack."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict

WORDS = ["hello", "world", "petrel", "token", "stream", "gateway", "worker", "limit"]
PROMPT = [504, 3458, 282, 4649, 314]  # a few ordinary SmolLM2 ids


def available() -> bool:
    """The grpc extra is installed (the run is left out of the default set without it)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("grpc", "smg_grpc_proto"))


def _request(pb, rid: str, max_tokens: int, **fields):
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_token_ids=PROMPT),
        sampling_config=pb.SamplingConfig(beam_width=1, num_return_sequences=1, temperature=0.0),
        output_config=pb.OutputConfig(exclude_input_from_output=True),
        max_tokens=max_tokens,
        streaming=True,
        **fields,
    )


def attack_requests() -> dict:
    """kind -> (request, whether it must be refused)."""
    from smg_grpc_proto import trtllm_service_pb2 as pb

    rng = random.Random(0)
    long_words = [f"{i} " + " ".join(rng.choice(WORDS) for _ in range(10_000)) for i in range(64)]
    return {
        "bad_100k": (_request(pb, "a", 1, bad=[f"w{i}" for i in range(100_000)]), True),
        "stop_100k": (_request(pb, "a", 1, stop=[f"s{i}" for i in range(100_000)]), True),
        "stop_ids_300k": (_request(pb, "a", 1, stop_token_ids=[5] * 300_000), True),
        "bad_64x60kB": (_request(pb, "a", 1, bad=long_words), False),
    }


def attacker_process(port: int, seconds: float, index: int, results) -> None:
    """One attacker: the attack requests in turn until `seconds` have passed; puts {kind: [(status, s), ...]}."""
    import grpc
    from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc

    requests = attack_requests()
    outcomes = defaultdict(list)
    deadline = time.monotonic() + seconds
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = pb_grpc.TrtllmServiceStub(channel)
        i = 0
        while time.monotonic() < deadline:
            kind = list(requests)[(i + index) % len(requests)]
            req, _ = requests[kind]
            req.request_id = f"attack-{index}-{i}"
            t0 = time.monotonic()
            try:
                list(stub.Generate(req, timeout=120))
                status = "OK"
            except grpc.RpcError as exc:
                status = exc.code().name
            outcomes[kind].append((status, time.monotonic() - t0))
            i += 1
    results.put(dict(outcomes))


def healthy_client(port: int, stop: threading.Event, out: dict) -> None:
    """HealthCheck, GetModelInfo and a 4-token Generate in a loop until `stop`: out[call] = [seconds, ...]."""
    import grpc
    from smg_grpc_proto import trtllm_service_pb2 as pb
    from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.TrtllmServiceStub(channel)
        calls = {
            "HealthCheck": lambda: stub.HealthCheck(pb.HealthCheckRequest(), timeout=120),
            "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=120),
            "Generate": lambda: list(stub.Generate(_request(pb, "healthy", 4), timeout=120)),
        }
        while not stop.is_set():
            for name, call in calls.items():
                t0 = time.monotonic()
                try:
                    call()
                    out.setdefault(name, []).append(time.monotonic() - t0)
                except grpc.RpcError as exc:
                    out.setdefault("errors", []).append(f"{name}: {exc.code().name}")
            stop.wait(0.1)


def _latencies(values: list, pct) -> dict:
    return {
        "n": len(values),
        "p50_s": round(pct(values, 50), 3) if values else None,
        "p99_s": round(pct(values, 99), 3) if values else None,
        "max_s": round(max(values), 3) if values else None,
    }


def _healthy_run(port: int, seconds: float, pct, during=None) -> dict:
    """The healthy client for `seconds` (or until `during()` returns) -> latencies per call."""
    stop, out = threading.Event(), {}
    thread = threading.Thread(target=healthy_client, args=(port, stop, out), daemon=True)
    thread.start()
    if during is None:
        time.sleep(seconds)
    else:
        during()
    stop.set()
    thread.join(150)
    report = {name: _latencies(values, pct) for name, values in out.items() if name != "errors"}
    report["errors"] = Counter(out.get("errors", []))
    return report


def grpc_lists(port: int, seconds: float, attackers: int, pct) -> dict:
    import multiprocessing

    baseline = _healthy_run(port, min(10.0, seconds / 3), pct)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=attacker_process, args=(port, seconds, i, results), daemon=True) for i in range(attackers)
    ]
    for proc in procs:
        proc.start()
    gathered = []

    def attack():
        for _ in procs:
            gathered.append(results.get(timeout=seconds + 300))

    t0 = time.monotonic()
    under_attack = _healthy_run(port, seconds, pct, during=attack)
    wall = time.monotonic() - t0
    for proc in procs:
        proc.join(30)
    outcomes = defaultdict(list)
    for result in gathered:
        for kind, values in result.items():
            outcomes[kind] += values
    must_refuse = {kind: refuse for kind, (_, refuse) in attack_requests().items()}
    attack_report = {
        kind: {
            "must_be_refused": must_refuse[kind],
            "statuses": dict(Counter(status for status, _ in values)),
            **{k: v for k, v in _latencies([s for _, s in values], pct).items() if k != "n"},
        }
        for kind, values in outcomes.items()
    }
    return {
        "attackers": attackers,
        "attack_s": seconds,
        "wall_s": round(wall, 1),
        "healthy_alone": baseline,
        "healthy_under_attack": under_attack,
        "attacks": attack_report,
    }


def grpc_lists_failures(report: dict, deadline: float) -> list[str]:
    failures = []
    healthy = report["healthy_under_attack"]
    if healthy["errors"]:
        failures.append(f"grpc_lists: the healthy client got errors: {dict(healthy['errors'])}")
    for call in ("HealthCheck", "GetModelInfo"):
        p99 = healthy.get(call, {}).get("p99_s")
        if p99 is None or p99 >= 1.0:
            failures.append(f"grpc_lists: healthy {call} p99 {p99} s (>= 1 s)")
    for kind, r in report["attacks"].items():
        if r["must_be_refused"] and (set(r["statuses"]) != {"INVALID_ARGUMENT"} or r["max_s"] >= deadline):
            failures.append(f"grpc_lists: {kind} not refused INVALID_ARGUMENT within {deadline} s: {r}")
        if not r["must_be_refused"] and set(r["statuses"]) != {"OK"}:
            failures.append(f"grpc_lists: {kind} (within the limits) not served: {r}")
    return failures
