"""petrel's gRPC worker (trtllm.TrtllmService, petrel/grpc/) on the tiny random Llama, over a real grpc channel:
the stream carries what the engine's OutputChunks carry, errors map to status codes, Abort ends the stream and
frees the KV blocks, the tokenizer bundle and KV events; and the HTTP worker extras (/v1/loads, /server_info)."""

from __future__ import annotations

import hashlib
import io
import threading
import time
import zipfile

import numpy as np
import pytest

grpc = pytest.importorskip("grpc", reason="the grpc extra is not installed (pip install petrel[grpc])")
pytest.importorskip("smg_grpc_proto", reason="the grpc extra is not installed (pip install petrel[grpc])")

from smg_grpc_proto import trtllm_service_pb2 as pb  # noqa: E402
from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc  # noqa: E402
from smg_grpc_proto.generated import common_pb2 as cpb  # noqa: E402
from tiny_llama import VOCAB, _tokens  # noqa: E402

from petrel import LLM  # noqa: E402
from petrel.grpc import build_grpc_server  # noqa: E402
from petrel.sampling_params import SamplingParams  # noqa: E402

WAIT = 10.0


@pytest.fixture(scope="module")
def llm(tiny, tmp_path_factory):
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    engine = LLM(tiny(2, False).path, tokenizer=str(path), kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def worker(llm):
    server = build_grpc_server(llm, "tiny", max_pending=8).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, pb_grpc.TrtllmServiceStub(channel)
    channel.close()
    server.stop()


def free_blocks(llm) -> int:
    return llm.engine.call(lambda core: core.block_manager.num_free_blocks)


def num_blocks(llm) -> int:
    return llm.engine.core.block_manager.num_blocks


def request(rid, prompt, max_tokens=6, streaming=True, n=1, temperature=0.0, seed=None, logprobs=None, **fields):
    cfg = pb.SamplingConfig(beam_width=1, num_return_sequences=n, temperature=temperature)
    if seed is not None:
        cfg.seed = seed
    out = pb.OutputConfig(exclude_input_from_output=True)
    if logprobs is not None:
        out.logprobs = logprobs
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_token_ids=prompt),
        sampling_config=cfg,
        output_config=out,
        max_tokens=max_tokens,
        streaming=streaming,
        **fields,
    )


def engine_chunks(llm, prompt, params) -> dict:
    """{sequence index: [OutputChunk, ...]} straight from the engine."""
    out: dict = {}
    for chunk in llm.generate_async(prompt, params, streaming=True).output_chunks():
        out.setdefault(chunk.index, []).append(chunk)
    return out


def grpc_stream(stub, req) -> tuple[dict, dict]:
    """({index: [GenerateStreamChunk]}, {index: GenerateComplete}); exactly one Complete per sequence."""
    chunks: dict = {}
    completes: dict = {}
    for resp in stub.Generate(req, timeout=WAIT):
        assert resp.request_id == req.request_id
        if resp.HasField("chunk"):
            assert resp.chunk.sequence_index not in completes, "a chunk after its sequence's Complete"
            chunks.setdefault(resp.chunk.sequence_index, []).append(resp.chunk)
        else:
            assert resp.complete.sequence_index not in completes, "two Completes for one sequence"
            completes[resp.complete.sequence_index] = resp.complete
    return chunks, completes


def f32(values) -> list:
    return np.asarray(values, dtype=np.float32).tolist()


def test_stream_carries_what_the_engine_chunks_carry(llm, worker):
    """Greedy with logprobs, seeded n=2, a stop token: the same ids per step, counts, logprobs (float32 on the
    wire), finish reason and matched stop in the gRPC stream as in the engine's per-step OutputChunks."""
    _, stub = worker
    prompt = _tokens(9, 1)
    plain = engine_chunks(llm, prompt, SamplingParams(temperature=0.0, max_tokens=8))[0]
    stop_token = [t for c in plain for t in c.output_ids][3]
    cases = [
        (dict(logprobs=2), SamplingParams(temperature=0.0, max_tokens=6, logprobs=2), {}),
        (dict(n=2, temperature=1.0, seed=7), SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=6), {}),
        (
            {},
            SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_token]),
            {"stop_token_ids": [stop_token]},
        ),
    ]
    for i, (kw, params, fields) in enumerate(cases):
        expected = engine_chunks(llm, prompt, params)
        if fields:
            assert expected[0][-1].finish_reason == "stop"
        chunks, completes = grpc_stream(stub, request(f"eq-{i}", prompt, max_tokens=params.max_tokens, **kw, **fields))
        assert sorted(completes) == sorted(expected) == list(range(params.n))
        for index, engine in expected.items():
            last = engine[-1]
            done = completes[index]
            ids = [t for c in engine for t in c.output_ids]
            wire = [t for c in chunks[index] for t in c.token_ids]
            stripped = ids[:-1] if last.finish_details.matched_token is not None else ids  # stop token not output
            assert wire == list(done.output_token_ids) == stripped
            steps = [c for c in engine if c.output_ids]
            assert [c.completion_tokens for c in chunks[index]][: len(stripped)] == [
                c.completion_tokens for c in steps
            ][: len(chunks[index])]
            assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (
                last.prompt_tokens,
                last.completion_tokens,
                last.cached_tokens,
            )
            assert done.finish_reason == last.finish_reason
            if last.finish_details.matched_token is not None:
                assert done.WhichOneof("matched_stop") == "matched_token_id"
                assert done.matched_token_id == last.finish_details.matched_token == stop_token
            else:
                assert done.WhichOneof("matched_stop") is None
            if params.logprobs is not None:
                lps = [lp for c in engine for lp in c.output_token_logprobs]
                tops = [top for c in engine for top in c.output_top_logprobs]
                assert [x.logprob for x in done.logprobs] == f32(lps)
                assert [x.logprob for c in chunks[index] for x in c.logprobs] == f32(lps)
                assert [[t.token_id for t in x.top_logprobs] for x in done.logprobs] == [
                    [t for t, _ in s] for s in tops
                ]
            else:
                assert not done.logprobs
    assert free_blocks(llm) == num_blocks(llm)


def test_non_streaming_sends_only_completes_and_prompt_logprobs(llm, worker):
    _, stub = worker
    prompt = _tokens(6, 2)
    req = request("ns", prompt, max_tokens=4, streaming=False, logprobs=0)
    req.output_config.prompt_logprobs = 1
    chunks, completes = grpc_stream(stub, req)
    assert not chunks and list(completes) == [0]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1), use_tqdm=False)
    assert list(completes[0].output_token_ids) == out.outputs[0].token_ids
    expected = [(t, lp[t].logprob) for t, lp in zip(prompt[1:], out.prompt_logprobs[1:])]
    assert [(x.token_id, x.logprob) for x in completes[0].prompt_logprobs] == [(t, f32([v])[0]) for t, v in expected]


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda r: r.sampling_config.SetInParent() or setattr(r.sampling_config, "top_p_decay", 0.5), "top_p_decay"),
        (lambda r: r.kv_cache_retention.SetInParent(), "kv_cache_retention"),
        (lambda r: r.lora_config.SetInParent(), "lora_config.task_id"),
        (lambda r: r.embedding_bias.extend([0.5] * 3), "embedding_bias"),
        (lambda r: setattr(r, "max_tokens", 0), "max_tokens"),
        (lambda r: r.tokenized.input_token_ids.extend([10**6]), "input_token_ids"),
        (lambda r: r.output_config.SetInParent() or setattr(r.output_config, "return_perf_metrics", True), "perf"),
        (lambda r: r.bad_token_ids.extend(range(VOCAB)), "bad_token_ids"),  # the whole vocabulary: nothing to say
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_what_petrel_cannot_honour_is_invalid_argument(llm, worker, change, field):
    _, stub = worker
    req = request("bad", _tokens(5, 3))
    change(req)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=WAIT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert llm.engine.num_unfinished_requests == 0


def test_overload_is_resource_exhausted_and_embed_unimplemented(worker):
    _, stub = worker
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request("big", _tokens(5, 4), n=9, temperature=1.0), timeout=WAIT))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_token_ids=[1, 2])))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Embed" in err.value.details()


def test_abort_ends_the_stream_and_frees_the_blocks(llm, worker):
    server, stub = worker
    stream = stub.Generate(request("long", _tokens(20, 5), max_tokens=200, ignore_eos=True), timeout=WAIT)
    first = next(stream)
    assert first.chunk.token_ids
    assert not stub.Abort(pb.AbortRequest(request_id="nobody")).success
    assert stub.Abort(pb.AbortRequest(request_id="long")).success
    rest = list(stream)  # the stream ends by itself (the gateway never cancels the call)
    assert not any(r.HasField("complete") for r in rest)
    assert sum(len(r.chunk.token_ids) for r in [first, *rest]) < 200
    assert server.servicer.num_aborts == 1 and not server.servicer.in_flight
    deadline = time.monotonic() + WAIT
    while free_blocks(llm) != num_blocks(llm) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert free_blocks(llm) == num_blocks(llm) and llm.engine.num_unfinished_requests == 0


def test_health_model_server_info(llm, worker, monkeypatch):
    _, stub = worker
    assert stub.HealthCheck(pb.HealthCheckRequest()).status == "OK"
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_id, info.max_seq_len, info.max_input_len) == (
        "tiny",
        llm.engine.max_model_len,
        llm.engine.max_model_len - 1,
    )
    assert info.vocab_size == 256 and info.max_batch_size == llm.config.max_num_seqs
    assert stub.GetServerInfo(pb.GetServerInfoRequest()).backend == "petrel"

    def broken(timeout=None):
        raise RuntimeError("the engine loop is not running")

    monkeypatch.setattr(llm.engine, "check_health", broken)
    with pytest.raises(grpc.RpcError) as err:
        stub.HealthCheck(pb.HealthCheckRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not running" in err.value.details()


def test_tokenizer_bundle_is_the_served_tokenizer(llm, worker, tmp_path):
    from transformers import AutoTokenizer

    _, stub = worker
    chunks = list(stub.GetTokenizer(cpb.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    text = "Hello, world: a gRPC worker."
    assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == llm.tokenizer(text)["input_ids"]


def test_kv_events_carry_the_prompt_blocks_and_the_load(llm, worker):
    _, stub = worker
    llm.engine.call(lambda core: core.block_manager.reset_prefix_cache())
    stream = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(load_records_before_first_batch=True), timeout=WAIT)
    first = next(stream)
    assert first.sequence_number == 0 and first.load.load_only
    assert first.load.max_running_requests == llm.config.max_num_seqs
    bs = llm.engine.core.block_manager.block_size
    prompt = _tokens(3 * bs + 2, 6)
    stored: list = []
    cleared = threading.Event()
    done = threading.Event()

    def read():
        for batch in stream:
            for event in batch.events:
                if event.HasField("stored"):
                    stored.extend(list(b.token_ids) for b in event.stored.blocks)
                    assert all(b.block_size == bs for b in event.stored.blocks)
                if event.HasField("cleared"):
                    cleared.set()
                    return
            if all(prompt[i * bs : (i + 1) * bs] in stored for i in range(3)):
                done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.2)  # the subscription registers with the engine loop
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert done.wait(WAIT), f"stored blocks seen: {stored}"
    llm.engine.call(lambda core: core.block_manager.reset_prefix_cache())
    assert cleared.wait(WAIT)
    stream.cancel()


def test_http_worker_extras(llm):
    import httpx

    from petrel.serve.app import build_app
    from petrel.serve.server import BackgroundServer

    with BackgroundServer(build_app(llm, "tiny")) as server:
        loads = httpx.get(f"{server.url}/v1/loads").json()
        assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
        load = loads["loads"][0]
        assert load["num_running_reqs"] == 0 and 0.0 <= load["token_usage"] <= 1.0
        assert load["max_total_num_tokens"] == num_blocks(llm) * llm.engine.core.block_manager.block_size
        info = httpx.get(f"{server.url}/server_info").json()
        assert info["backend"] == "petrel" and info["max_model_len"] == llm.engine.max_model_len
        model = httpx.get(f"{server.url}/model_info").json()
        assert model["served_model_name"] == "tiny" and model["vocab_size"] == 256


def test_vllm_service_splits_prefill_and_decode(tiny, llm):
    """The vLLM-protocol service (what smg's --pd-disaggregation drives): a prefill-role service answers the
    gateway's prefill leg (max_tokens 1) context-only with the DisaggregatedParams as kv_transfer_params_json; the
    decode-role service given that JSON fetches the KV and decodes on: the tokens of one plain run, the pin is gone.
    With max_tokens 1 the decode service runs the request whole."""
    import socket

    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    both = LLM(
        tiny(2, False).path,
        tokenizer=llm.config.tokenizer,
        kv_cache_memory=1 << 20,
        kv_transfer_role="both",
        kv_transfer_secret="test",
        kv_transfer_port=port,
        kv_transfer_peers=[f"127.0.0.1:{port}"],
    )
    servers = [build_grpc_server(both, "tiny", service="vllm", pd_role=r).start() for r in ("prefill", "decode")]
    try:
        prefill, decode = (vpb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{s.port}")) for s in servers)
        info = prefill.GetServerInfo(vpb.GetServerInfoRequest())
        assert (info.kv_connector, info.kv_role) == ("PetrelConnector", "kv_producer")
        assert decode.GetServerInfo(vpb.GetServerInfoRequest()).kv_role == "kv_consumer"
        prompt = _tokens(21, 8)
        want = both.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False).outputs[0]

        def generate(stub, max_tokens, stream, kv=None):
            sp = vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1, ignore_eos=max_tokens == 1)
            req = vpb.GenerateRequest(
                request_id="pd", tokenized=vpb.TokenizedInput(input_ids=prompt), sampling_params=sp, stream=stream
            )
            if kv is not None:
                req.kv_transfer_params_json = kv
            return list(stub.Generate(req, timeout=WAIT))

        first = generate(prefill, 1, False)
        assert len(first) == 1 and list(first[0].complete.output_ids) == want.token_ids[:1]
        kv = first[0].complete.kv_transfer_params_json
        assert json_keys(kv) >= {"first_gen_tokens", "opaque_state", "ctx_info_endpoint"}
        out = generate(decode, 6, True, kv)
        assert [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids] == want.token_ids
        assert sum(r.chunk.completion_tokens for r in out if r.HasField("chunk")) == len(want.token_ids)
        assert list(out[-1].complete.output_ids) == want.token_ids
        assert both.engine.core.pinned.held == (0, 0)  # fetched: the pin is gone
        assert servers[0].servicer.request_types == {"context_only": 1}
        assert servers[1].servicer.request_types == {"generation_only": 1}
        whole = generate(decode, 1, False, generate(prefill, 1, False)[0].complete.kv_transfer_params_json)
        assert list(whole[0].complete.output_ids) == want.token_ids[:1]
        assert servers[1].servicer.request_types[None] == 1
    finally:
        for s in servers:
            s.stop()
        both.shutdown()


def json_keys(text: str) -> set:
    import json

    return set(json.loads(text))


def test_petrel_serve_grpc_port_answers_and_exits_on_sigterm(tiny, tmp_path):
    """`petrel serve --port P --grpc-port G` as a real process: gRPC HealthCheck / GetModelInfo and HTTP /v1/loads
    answer over the same engine; SIGTERM exits 0 and closes the gRPC port."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    import httpx

    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    load_tokenizer(resolve_model(None)).save_pretrained(tmp_path)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    http_port, grpc_port = ports
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [
        sys.executable, "-m", "petrel.cli", "serve", "--model", tiny(2, False).path, "--tokenizer", str(tmp_path),
        "--served-model-name", "tiny", "--kv-cache-memory", str(1 << 20), "--max-num-seqs", "4",
        "--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-2000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "petrel serve did not come up"
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.TrtllmServiceStub(channel)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=WAIT).status == "OK"
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT)
        http_info = httpx.get(f"{base}/model_info", timeout=WAIT).json()
        assert info.model_id == "tiny" == http_info["served_model_name"]
        assert info.vocab_size == 256 == http_info["vocab_size"]
        assert info.max_seq_len == http_info["max_model_len"] and info.max_batch_size == 4
        loads = httpx.get(f"{base}/v1/loads", timeout=WAIT).json()
        (load,) = loads["loads"]
        assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0 and load["max_running_requests"] == 4
        assert load["max_total_num_tokens"] > 0 and load["token_usage"] == 0.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode(errors="replace")[-2000:]
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", grpc_port)) != 0, "the gRPC port is still open"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
