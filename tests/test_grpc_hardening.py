"""The gRPC worker (petrel/grpc/) against hostile requests and callers without the key, on the tiny random Llama:
every list a request carries has the HTTP server's limit and is refused at once naming its field (both services);
a large request within the limits is prepared off the gRPC event loop, so HealthCheck, GetModelInfo and small
requests stay fast meanwhile, and a server stopping does not wait for it; with an API key every call but
HealthCheck needs metadata `authorization: Bearer <key>` (both services); `petrel serve` binds the gRPC port at
--host, enforces --api-key there, and exits at once on SIGTERM with a large request being prepared."""

from __future__ import annotations

import random
import threading
import time

import pytest

grpc = pytest.importorskip("grpc", reason="the grpc extra is not installed (pip install petrel[grpc])")
pytest.importorskip("smg_grpc_proto", reason="the grpc extra is not installed (pip install petrel[grpc])")

from smg_grpc_proto import trtllm_service_pb2 as pb  # noqa: E402
from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc  # noqa: E402
from tiny_llama import _tokens  # noqa: E402

from petrel import LLM  # noqa: E402
from petrel.grpc import build_grpc_server  # noqa: E402
from petrel.sampling_params import SamplingParams  # noqa: E402
from petrel.serve.params import MAX_BAD_WORDS, MAX_STOP_STRINGS  # noqa: E402
from petrel.serve.protocol import MAX_ITEMS, MAX_LOGPROBS  # noqa: E402

WAIT = 30.0
KEY = "k-3f9a"
AUTH = (("authorization", f"Bearer {KEY}"),)
WORDS = ["hello", "world", "petrel", "token", "stream", "gateway", "worker", "limit"]


@pytest.fixture(scope="module")
def llm(tiny, tokenizer_dir):
    engine = LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def trtllm(llm):
    server = build_grpc_server(llm, "tiny", api_key=KEY).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, pb_grpc.TrtllmServiceStub(channel)
    channel.close()
    server.stop()


@pytest.fixture(scope="module")
def vllm(llm):
    server = build_grpc_server(llm, "tiny", service="vllm", api_key=KEY).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, vpb_grpc.VllmEngineStub(channel)
    channel.close()
    server.stop()


def trt_request(rid, prompt, max_tokens=4, **fields):
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_token_ids=prompt),
        sampling_config=pb.SamplingConfig(beam_width=1, num_return_sequences=1, temperature=0.0),
        output_config=pb.OutputConfig(exclude_input_from_output=True),
        max_tokens=max_tokens,
        streaming=True,
        **fields,
    )


def vllm_request(rid, prompt, max_tokens=4):
    sp = vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1)
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=prompt), sampling_params=sp)


def long_words(count: int, chars: int) -> list[str]:
    """`count` distinct bad words of about `chars` characters of ordinary text each."""
    rng = random.Random(0)
    return [f"{i} " + " ".join(rng.choice(WORDS) for _ in range(chars // 6)) for i in range(count)]


def large_request(rid: str) -> pb.GenerateRequest:
    """Within every limit (MAX_BAD_WORDS bad words), but each word is ~80 kB to tokenize: seconds of preparation.
    The tiny model's vocabulary (256) is smaller than the tokenizer's, so it ends INVALID_ARGUMENT once checked."""
    return trt_request(rid, _tokens(8, 1), bad=long_words(MAX_BAD_WORDS, 80_000))


def refused(call, *args) -> tuple[grpc.StatusCode, str, float]:
    """call(*args) raised RpcError: (its code, its details, seconds it took)."""
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    return err.value.code(), err.value.details(), time.monotonic() - t0


TRT_HUGE = {
    "bad": lambda r: r.bad.extend(f"w{i}" for i in range(100_000)),
    "stop": lambda r: r.stop.extend(f"s{i}" for i in range(MAX_STOP_STRINGS + 1)),
    "stop_token_ids": lambda r: r.stop_token_ids.extend([5] * (MAX_ITEMS + 1)),
    "bad_token_ids": lambda r: r.bad_token_ids.extend([5] * (MAX_ITEMS + 1)),
    "sampling_config.beam_width": lambda r: setattr(r.sampling_config, "beam_width", 17),
    "output_config.logprobs": lambda r: setattr(r.output_config, "logprobs", MAX_LOGPROBS + 1),
    "output_config.prompt_logprobs": lambda r: setattr(r.output_config, "prompt_logprobs", MAX_LOGPROBS + 1),
    "guided_decoding.guide": lambda r: r.guided_decoding.CopyFrom(
        pb.GuidedDecodingParams(guide_type=pb.GuidedDecodingParams.GUIDE_TYPE_JSON_SCHEMA, guide="[" * 4_000_000)
    ),
}
VLLM_HUGE = {
    "sampling_params.stop": lambda r: r.sampling_params.stop.extend(f"s{i}" for i in range(MAX_STOP_STRINGS + 1)),
    "sampling_params.stop_token_ids": lambda r: r.sampling_params.stop_token_ids.extend([5] * (MAX_ITEMS + 1)),
    "sampling_params.logit_bias": lambda r: r.sampling_params.logit_bias.update({i: 1.0 for i in range(MAX_ITEMS + 1)}),
    "sampling_params.logprobs": lambda r: setattr(r.sampling_params, "logprobs", MAX_LOGPROBS + 1),
    "sampling_params.prompt_logprobs": lambda r: setattr(r.sampling_params, "prompt_logprobs", -1),
    "sampling_params.json_schema": lambda r: setattr(r.sampling_params, "json_schema", "[" * 4_000_000),
}


@pytest.mark.parametrize("field", list(TRT_HUGE))
def test_trtllm_lists_past_their_limits_are_refused_at_once(llm, trtllm, field):
    """100,000 `bad` strings took minutes on the gRPC loop (tokenized, then de-duplicated by a list search)."""
    _, stub = trtllm
    req = trt_request("huge", _tokens(5, 3))
    TRT_HUGE[field](req)
    code, details, seconds = refused(lambda: list(stub.Generate(req, metadata=AUTH, timeout=WAIT)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field} "), details
    assert "at most" in details or "allows 0 to" in details
    assert seconds < 2.0
    assert llm.engine.num_unfinished_requests == 0


@pytest.mark.parametrize("field", list(VLLM_HUGE))
def test_vllm_lists_past_their_limits_are_refused_at_once(llm, vllm, field):
    _, stub = vllm
    req = vllm_request("huge", _tokens(5, 3))
    VLLM_HUGE[field](req)
    code, details, seconds = refused(lambda: list(stub.Generate(req, metadata=AUTH, timeout=WAIT)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field} "), details
    assert seconds < 2.0
    assert llm.engine.num_unfinished_requests == 0


def test_repeated_token_ids_within_the_limit_are_served_once_each(llm, trtllm):
    """The largest id lists allowed still run: repeats are dropped (each id is looked up after every token)."""
    _, stub = trtllm
    prompt = _tokens(6, 4)
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False).outputs[0].token_ids
    banned = next(t for t in range(3, 256) if t not in want)
    req = trt_request("ids", prompt, stop_token_ids=[banned] * MAX_ITEMS, bad_token_ids=[banned] * MAX_ITEMS)
    out = list(stub.Generate(req, metadata=AUTH, timeout=WAIT))
    assert list(out[-1].complete.output_token_ids) == want


def test_a_large_request_leaves_the_service_responsive(llm, trtllm):
    """A request within the limits whose preparation takes seconds (64 bad words of 80 kB to tokenize): HealthCheck,
    GetModelInfo and a small Generate keep answering in a fraction of its time (before: each waited for all of it,
    the preparation ran on the gRPC event loop)."""
    _, stub = trtllm
    outcome = {}

    def large():
        t0 = time.monotonic()
        try:
            list(stub.Generate(large_request("large"), metadata=AUTH, timeout=120))
            outcome["code"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome["code"], outcome["details"] = exc.code(), exc.details()
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=large)
    thread.start()
    calls = {
        "HealthCheck": lambda: stub.HealthCheck(pb.HealthCheckRequest(), timeout=120),
        "GetModelInfo": lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=120),
        "Generate": lambda: list(stub.Generate(trt_request("small", _tokens(5, 9)), metadata=AUTH, timeout=120)),
    }
    seconds = {name: [] for name in calls}
    while thread.is_alive():
        for name, call in calls.items():
            t0 = time.monotonic()
            call()
            seconds[name].append(time.monotonic() - t0)
        time.sleep(0.05)
    thread.join()
    assert outcome["code"] == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in outcome["details"]
    took = outcome["seconds"]
    slowest = {name: max(values) for name, values in seconds.items()}
    assert took > 0.5, f"the large request took only {took:.2f} s: nothing to measure"
    assert max(slowest.values()) < min(1.0, took / 4), f"slowest {slowest} while the large request took {took:.2f} s"
    assert llm.engine.num_unfinished_requests == 0


def test_stopping_does_not_wait_for_a_request_being_prepared(llm, monkeypatch):
    """stop() ends a call whose large request is still being prepared with UNAVAILABLE (another worker may take
    it) instead of waiting for the preparation (before: for all of it, the event loop being busy with it)."""
    import petrel.grpc.servicer as servicer_module

    arrived = threading.Event()
    original = servicer_module.generate_args

    def noted(request, limits):
        arrived.set()
        return original(request, limits)

    monkeypatch.setattr(servicer_module, "generate_args", noted)
    server = build_grpc_server(llm, "tiny").start()
    outcome = {}

    def large():
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            try:
                list(pb_grpc.TrtllmServiceStub(channel).Generate(large_request("stopping"), timeout=120))
            except grpc.RpcError as exc:
                outcome["code"] = exc.code()

    thread = threading.Thread(target=large)
    thread.start()
    assert arrived.wait(WAIT)
    time.sleep(0.2)  # its bad words are being tokenized (seconds of work)
    t0 = time.monotonic()
    server.stop()
    stopped = time.monotonic() - t0
    thread.join(WAIT)
    assert stopped < 1.0, f"stop() took {stopped:.2f} s"
    assert outcome["code"] == grpc.StatusCode.UNAVAILABLE


def test_abort_while_being_prepared_ends_the_request(llm, trtllm, monkeypatch):
    """An Abort that arrives while the request is being prepared ends it once it is queued: its stream ends without
    a Complete and nothing is left running."""
    import petrel.grpc.servicer as servicer_module

    server, stub = trtllm
    release = threading.Event()
    original = servicer_module.generate_args

    def held(request, limits):
        release.wait(WAIT)
        return original(request, limits)

    monkeypatch.setattr(servicer_module, "prepares_slowly", lambda request: True)
    monkeypatch.setattr(servicer_module, "generate_args", held)
    outcome = {}

    def call():
        req = trt_request("prep", _tokens(5, 2), max_tokens=200, ignore_eos=True)
        outcome["responses"] = list(stub.Generate(req, metadata=AUTH, timeout=WAIT))

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + WAIT
    while "prep" not in server.servicer.in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert stub.Abort(pb.AbortRequest(request_id="prep"), metadata=AUTH).success
    release.set()
    thread.join(WAIT)
    assert not any(r.HasField("complete") for r in outcome["responses"])
    assert sum(len(r.chunk.token_ids) for r in outcome["responses"]) < 200
    deadline = time.monotonic() + WAIT
    while llm.engine.num_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert llm.engine.num_unfinished_requests == 0 and not server.servicer.in_flight


@pytest.mark.parametrize("service", ["trtllm", "vllm"])
def test_guided_decoding_compiles_beside_the_event_loop(llm, trtllm, vllm, service):
    """A constraint compiles on the grammar workers, awaited by the call: the output follows it; one that does not
    compile is INVALID_ARGUMENT naming guided decoding."""
    stub = (trtllm if service == "trtllm" else vllm)[1]

    def generate(regex):
        if service == "trtllm":
            guide = pb.GuidedDecodingParams(guide_type=pb.GuidedDecodingParams.GUIDE_TYPE_REGEX, guide=regex)
            req = trt_request("guided", _tokens(5, 6), max_tokens=8, guided_decoding=guide)
        else:
            req = vllm_request("guided", _tokens(5, 6), max_tokens=8)
            req.sampling_params.regex = regex
        out = list(stub.Generate(req, metadata=AUTH, timeout=WAIT))
        complete = out[-1].complete
        return list(complete.output_token_ids if service == "trtllm" else complete.output_ids)

    ids = generate("[0-9]{3}")
    assert len(ids) >= 3 and llm.tokenizer.decode(ids[:3]).isdigit(), ids
    code, details, _ = refused(generate, "([0-9]")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "guided_decoding" in details, details
    assert llm.engine.num_unfinished_requests == 0


BAD_CREDENTIALS = {
    "none": None,
    "wrong_key": (("authorization", "Bearer wrong"),),
    "key_without_scheme": (("authorization", KEY),),
    "basic_scheme": (("authorization", f"Basic {KEY}"),),
    "key_as_prefix": (("authorization", f"Bearer {KEY}x"),),
}


def auth_calls(service: str, stub) -> tuple:
    """(module, GetModelInfo, GetServerInfo, Generate), each taking the call's metadata."""
    module = pb if service == "trtllm" else vpb
    make = trt_request if service == "trtllm" else vllm_request

    def info(metadata):
        return stub.GetModelInfo(module.GetModelInfoRequest(), metadata=metadata, timeout=WAIT)

    def server_info(metadata):
        return stub.GetServerInfo(module.GetServerInfoRequest(), metadata=metadata, timeout=WAIT)

    def generate(metadata):
        return list(stub.Generate(make("auth", _tokens(5, 5)), metadata=metadata, timeout=WAIT))

    return module, info, server_info, generate


@pytest.mark.parametrize("service", ["trtllm", "vllm"])
def test_api_key_is_required_on_every_call_but_health_check(llm, trtllm, vllm, service):
    stub = (trtllm if service == "trtllm" else vllm)[1]
    module, info, server_info, generate = auth_calls(service, stub)
    for name, metadata in BAD_CREDENTIALS.items():
        for call in (info, server_info, generate):
            code, details, _ = refused(call, metadata)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in details, (name, details)
    assert llm.engine.num_unfinished_requests == 0
    stub.HealthCheck(module.HealthCheckRequest(), timeout=WAIT)  # open, as HTTP's /health is
    assert info(AUTH).vocab_size == 256
    assert info((("authorization", f"bearer {KEY}"),)).vocab_size == 256  # the scheme in any case, as HTTP
    out = generate(AUTH)
    assert out and out[-1].HasField("complete")


def test_petrel_serve_grpc_binds_at_host_takes_the_api_key_and_exits_at_once(tiny, tokenizer_dir):
    """`petrel serve --host 127.0.0.2 --api-key K --grpc-port G`: the gRPC port listens at 127.0.0.2 only, takes
    the key (HealthCheck open), and SIGTERM with a large request being prepared exits 0 within seconds."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    import httpx

    host = "127.0.0.2"
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
    http_port, grpc_port = ports
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable, "-m", "petrel.cli", "serve", "--model", tiny(2, False).path, "--tokenizer", tokenizer_dir,
        "--served-model-name", "tiny", "--kv-cache-memory", str(1 << 20), "--host", host, "--api-key", KEY,
        "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-2000:]
            try:
                if httpx.get(f"http://{host}:{http_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "petrel serve did not come up"
            time.sleep(0.2)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", grpc_port)) != 0, "the gRPC port listens beyond --host"
        with grpc.insecure_channel(f"{host}:{grpc_port}") as channel:
            stub = pb_grpc.TrtllmServiceStub(channel)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=WAIT).status == "OK"
            code, _, _ = refused(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=WAIT).model_id == "tiny"
            outcome = {}

            def large():
                try:
                    list(stub.Generate(large_request("large"), metadata=AUTH, timeout=120))
                except grpc.RpcError as exc:
                    outcome["code"] = exc.code()

            thread = threading.Thread(target=large)
            thread.start()
            time.sleep(0.5)  # being prepared
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, proc.stderr.read().decode(errors="replace")[-2000:]
            exited = time.monotonic() - t0
            thread.join(WAIT)
        assert exited < 5.0, f"SIGTERM took {exited:.1f} s to exit"
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
