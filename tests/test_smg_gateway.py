"""Two petrel gRPC workers (trtllm.TrtllmService) behind the real Shepherd Model Gateway (`smg launch --worker-urls
grpc://... grpc://...`), on the default model: the official openai client through the gateway gets what
`petrel serve` answers directly (greedy chat and completions, streamed and not, n=2, logprobs); a client hanging up
mid-stream makes the gateway send Abort, which ends petrel's stream and frees the KV blocks; prompts sharing a long
prefix go to the worker whose KV events published it and report cached tokens; with one worker gone, requests go
to the other."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("grpc", reason="the grpc extra is not installed (pip install petrel[grpc])")
pytest.importorskip("smg_grpc_proto", reason="the grpc extra is not installed (pip install petrel[grpc])")
openai = pytest.importorskip("openai")
SMG = shutil.which("smg") or shutil.which("smg", path=os.path.dirname(sys.executable))
if SMG is None:
    pytest.skip("smg wheel not installed (linux x86_64 only: cp38-abi3-manylinux_2_17_x86_64)", allow_module_level=True)

from petrel import LLM  # noqa: E402
from petrel.grpc import build_grpc_server  # noqa: E402
from petrel.sampling_params import SamplingParams  # noqa: E402
from petrel.serve.app import DEFAULT_MODEL_NAME, build_app  # noqa: E402
from petrel.serve.server import BackgroundServer  # noqa: E402

WAIT = 60.0
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The three primary colours are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(worker_ports: list[int], pd: bool = False) -> tuple[subprocess.Popen, str]:
    """`smg launch` over grpc workers; pd: the first is the prefill worker, the second the decode worker."""
    port = free_port()
    urls = [f"grpc://127.0.0.1:{p}" for p in worker_ports]
    workers = ["--pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]] if pd else ["--worker-urls", *urls]
    cmd = [
        SMG, "launch", *workers,
        "--model-path", DEFAULT_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
        "--log-level", "warn",
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1",
        "--worker-startup-check-interval", "1", "--worker-stall-secs", "2",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # the gateway takes the tokenizer from the workers (GetTokenizer)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}/v1"


def stop_gateway(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # by pid: the process renames itself smg::router
    try:
        proc.wait(3)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(client, proc) -> None:
    """Until the gateway answers a short completion (the tokenizer loads after the workers register)."""
    deadline = time.monotonic() + WAIT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited: {proc.stderr.read().decode(errors='replace')[-2000:]}")
        try:
            client.completions.create(model=DEFAULT_MODEL_NAME, prompt="hi", max_tokens=2)
            return
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(llm):
    """(gateway client, direct petrel serve client, [worker servers], [LLMs], gateway process). The second engine
    also takes both disaggregation roles (its own KV transfer peer), for the PD test."""
    transfer_port = free_port()
    second = LLM(
        kv_transfer_role="both",
        kv_transfer_secret="gateway-test",
        kv_transfer_port=transfer_port,
        kv_transfer_peers=[f"127.0.0.1:{transfer_port}"],
    )
    workers = [build_grpc_server(e, DEFAULT_MODEL_NAME).start() for e in (llm, second)]
    direct = BackgroundServer(build_app(llm)).start()
    proc, url = start_gateway([w.port for w in workers])
    try:
        gateway = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=WAIT)
        wait_ready(gateway, proc)
        plain = openai.OpenAI(base_url=f"{direct.url}/v1", api_key="none", max_retries=0, timeout=WAIT)
        yield gateway, plain, workers, [llm, second], proc
    finally:
        stop_gateway(proc)
        direct.stop()
        for w in workers:
            w.stop()
        second.shutdown()


def chat_text(client, stream: bool, **kw) -> tuple[list[str], object]:
    args = dict(model=DEFAULT_MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=8, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)], r.usage
    texts: dict = {}
    usage = None
    for ev in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        usage = ev.usage or usage
        for c in ev.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return [texts[i] for i in sorted(texts)], usage


def completion_text(client, stream: bool, **kw) -> tuple[list[str], object]:
    args = dict(model=DEFAULT_MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=8, **kw)
    if not stream:
        r = client.completions.create(**args)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)], r.usage
    texts: dict = {}
    usage = None
    for ev in client.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        usage = ev.usage or usage
        for c in ev.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return [texts[i] for i in sorted(texts)], usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("call", [chat_text, completion_text])
def test_gateway_answers_what_petrel_serve_answers(cluster, call, stream):
    """Greedy: the same text and usage; streamed with n=2 (both choices), else n=1."""
    gateway, plain, *_ = cluster
    n = 2 if stream else 1
    got, got_usage = call(gateway, stream, n=n)
    want, want_usage = call(plain, stream, n=n)
    assert got == want and len(got) == n and got[0]
    if n == 2:
        assert got[0] == got[1]
    assert (got_usage.prompt_tokens, got_usage.completion_tokens) == (
        want_usage.prompt_tokens,
        want_usage.completion_tokens,
    )


def test_gateway_chat_logprobs_match(cluster):
    gateway, plain, *_ = cluster
    args = dict(model=DEFAULT_MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    got = gateway.chat.completions.create(**args).choices[0].logprobs.content
    want = plain.chat.completions.create(**args).choices[0].logprobs.content
    assert [t.token for t in got] == [t.token for t in want]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], rel=1e-5, abs=1e-6)
    assert [[a.token for a in t.top_logprobs] for t in got] == [[a.token for a in t.top_logprobs] for t in want]


def _all_blocks_free(engines) -> bool:
    return all(
        e.engine.call(lambda core: core.block_manager.num_free_blocks) == e.engine.core.block_manager.num_blocks
        for e in engines
    )


def test_client_disconnect_aborts_the_request(cluster):
    gateway, _, workers, engines, _ = cluster
    before = sum(w.servicer.num_aborts for w in workers)
    stream = gateway.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=MESSAGES, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if sum(w.servicer.num_aborts for w in workers) > before and not any(w.servicer.in_flight for w in workers):
            break
        time.sleep(0.1)
    assert sum(w.servicer.num_aborts for w in workers) == before + 1
    assert not any(w.servicer.in_flight for w in workers)
    assert all(e.engine.num_unfinished_requests == 0 for e in engines) and _all_blocks_free(engines)


def test_shared_prefix_goes_to_the_worker_that_cached_it(cluster):
    """A long prompt warmed on one worker directly (the gateway never saw it) goes to that worker, for each worker:
    routing follows its KV events. The answer reports the cached prefix."""
    gateway, _, workers, engines, _ = cluster
    bs = engines[0].engine.core.block_manager.block_size
    for w, word in ((1, "colour"), (0, "shape")):
        prefix = " ".join(f"item{i} has {word} number {i * 7 % 11};" for i in range(30))
        engines[w].generate(prefix, SamplingParams(max_tokens=1), use_tqdm=False)  # published as KV events
        time.sleep(0.5)
        before = [e.engine.core.scheduler.prefix_queried_tokens for e in engines]
        r = gateway.completions.create(model=DEFAULT_MODEL_NAME, prompt=prefix + " So", max_tokens=1, temperature=0)
        after = [e.engine.core.scheduler.prefix_queried_tokens for e in engines]
        assert after[w] > before[w] and after[1 - w] == before[1 - w], f"not routed to worker {w}"
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        assert cached >= bs * 8


def test_requests_go_to_the_other_worker_when_one_is_gone(cluster):
    gateway, _, workers, engines, _ = cluster
    workers[0].stop(grace=0)
    for i in range(4):
        r = gateway.completions.create(model=DEFAULT_MODEL_NAME, prompt=f"{i} + {i} =", max_tokens=2, temperature=0)
        assert r.choices[0].text is not None


def test_prefill_decode_through_the_gateway_equals_one_server(cluster):
    """smg --pd-disaggregation over petrel's vLLM-protocol service: the prefill worker runs context_only and
    returns its DisaggregatedParams as kv_transfer_params_json, the gateway relays them, the decode worker fetches
    the prompt's KV over petrel's transfer and decodes on: the same greedy text and usage as one server."""
    _, plain, _, engines, _ = cluster
    roles = [
        build_grpc_server(engines[1], DEFAULT_MODEL_NAME, service="vllm", pd_role=r).start()
        for r in ("prefill", "decode")
    ]
    proc, url = start_gateway([w.port for w in roles], pd=True)
    try:
        gateway = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=WAIT)
        wait_ready(gateway, proc)
        for call in (chat_text, completion_text):
            for stream in (False, True):
                got, got_usage = call(gateway, stream)
                want, want_usage = call(plain, stream)
                assert got == want and got[0]
                assert (got_usage.prompt_tokens, got_usage.completion_tokens) == (
                    want_usage.prompt_tokens,
                    want_usage.completion_tokens,
                )
        prefill, decode = (w.servicer.request_types for w in roles)
        assert prefill["context_only"] >= 4 and set(prefill) <= {"context_only"}
        assert decode["generation_only"] >= 4
        assert engines[1].engine.core.pinned.held == (0, 0)  # every prefill's KV was fetched
    finally:
        stop_gateway(proc)
        for w in roles:
            w.stop()
