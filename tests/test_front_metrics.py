"""/metrics counts every request the engine serves, whatever its front: the HTTP endpoints (completions, chat,
Responses, streamed or not), the gRPC worker's trtllm and vLLM services, and the LLM API called in the server's own
process, each counted the same (success by finish reason, prompt and generated tokens, TTFT / TPOT / end-to-end
histograms); a request given up on before its end (a gRPC call cancelled or aborted, the LLM API's abort) counts as
aborted and a gRPC request refused for room as rejected. Disaggregated serving counts the KV it hands off and
fetches (count, bytes, time), the fetches that fail, and the pins held and expired.

On the tiny random Llama: one engine behind an app and both gRPC services; a prefill and a decode instance, each
behind its own app."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from petrel import LLM, SamplingParams
from petrel.grpc import build_grpc_server
from petrel.serve.app import build_app
from petrel.serve.server import BackgroundServer

grpc = pytest.importorskip("grpc", reason="the grpc extra is not installed (pip install petrel[grpc])")
pytest.importorskip("smg_grpc_proto", reason="the grpc extra is not installed (pip install petrel[grpc])")

from smg_grpc_proto import trtllm_service_pb2 as pb  # noqa: E402
from smg_grpc_proto import trtllm_service_pb2_grpc as pb_grpc  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc  # noqa: E402
from tiny_llama import _tokens  # noqa: E402

MODEL = "tiny"
LABEL = f'model_name="{MODEL}"'
MAX_TOKENS = 5
WAIT = 30.0
PROMPT = _tokens(11, 3)
TEXT = "x~y~z"  # characters whose tokens are in the tiny model's 256-token vocabulary
MESSAGES = [{"role": "user", "content": TEXT}]
# the chat template writes nothing else but the control tokens <|im_start|> (1) and <|im_end|> (2)
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"


def samples(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=WAIT, trust_env=False).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(s: dict[str, float], name: str) -> float:
    """The sum of a metric over its label sets (this model's)."""
    return sum(v for k, v in s.items() if k.startswith(name + "{") and LABEL in k)


def delta(before: dict, after: dict, name: str) -> float:
    return total(after, name) - total(before, name)


def wait_until(check, seconds: float = WAIT) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def llm(tiny, tokenizer_dir):
    engine = LLM(tiny(2, False).path, tokenizer=tokenizer_dir, kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def served(llm):
    """One engine behind every front: the app's url, trtllm and vllm (stubs of the two gRPC services), and
    their servers (trtllm_server, vllm_server)."""
    with BackgroundServer(build_app(llm, MODEL, chat_template=TEMPLATE)) as http:
        trtllm = build_grpc_server(llm, MODEL).start()
        vllm = build_grpc_server(llm, MODEL, service="vllm").start()
        channels = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in (trtllm, vllm)]
        try:
            yield SimpleNamespace(
                url=http.url,
                trtllm=pb_grpc.TrtllmServiceStub(channels[0]),
                vllm=vpb_grpc.VllmEngineStub(channels[1]),
                trtllm_server=trtllm,
                vllm_server=vllm,
            )
        finally:
            for channel in channels:
                channel.close()
            trtllm.stop()
            vllm.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=WAIT, trust_env=False)
    assert r.status_code == 200, r.text
    return r


def _streamed_usage(r: httpx.Response) -> dict:
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return events[-1]["usage"]


def _trtllm_request(rid: str, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_token_ids=PROMPT),
        sampling_config=pb.SamplingConfig(beam_width=1, num_return_sequences=1, temperature=0.0),
        output_config=pb.OutputConfig(exclude_input_from_output=True),
        max_tokens=max_tokens,
        streaming=True,
    )


def _vllm_request(rid: str, max_tokens: int = MAX_TOKENS, stream: bool = False) -> vpb.GenerateRequest:
    sp = vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1, ignore_eos=True)
    return vpb.GenerateRequest(
        request_id=rid, tokenized=vpb.TokenizedInput(input_ids=PROMPT), sampling_params=sp, stream=stream
    )


# each front: send one request, return (prompt tokens, generated tokens) as the front itself reported them
def _completions(llm, s):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    u = _post(s.url, "/v1/completions", body).json()["usage"]
    return u["prompt_tokens"], u["completion_tokens"]


def _completions_stream(llm, s):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    u = _streamed_usage(_post(s.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}}))
    return u["prompt_tokens"], u["completion_tokens"]


def _chat(llm, s):
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    u = _post(s.url, "/v1/chat/completions", body).json()["usage"]
    return u["prompt_tokens"], u["completion_tokens"]


def _chat_stream(llm, s):
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    u = _streamed_usage(_post(s.url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}))
    return u["prompt_tokens"], u["completion_tokens"]


def _responses(llm, s):
    u = _post(s.url, "/v1/responses", {"input": TEXT, "max_output_tokens": MAX_TOKENS}).json()["usage"]
    return u["input_tokens"], u["output_tokens"]


def _grpc_trtllm(llm, s):
    responses = s.trtllm.Generate(_trtllm_request("m-trt"), timeout=WAIT)
    (complete,) = [r.complete for r in responses if r.HasField("complete")]
    return complete.prompt_tokens, complete.completion_tokens


def _grpc_vllm(llm, s):
    (response,) = list(s.vllm.Generate(_vllm_request("m-vllm"), timeout=WAIT))
    return response.complete.prompt_tokens, response.complete.completion_tokens


def _llm_api(llm, s):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return len(out.prompt_token_ids), len(out.outputs[0].token_ids)


FRONTS = {
    "http_completions": _completions,
    "http_completions_stream": _completions_stream,
    "http_chat": _chat,
    "http_chat_stream": _chat_stream,
    "http_responses": _responses,
    "grpc_trtllm": _grpc_trtllm,
    "grpc_vllm": _grpc_vllm,
    "llm_api_in_process": _llm_api,
}


@pytest.mark.parametrize("front", list(FRONTS))
def test_every_front_is_counted_the_same(llm, served, front):
    before = samples(served.url)
    prompt_tokens, generated = FRONTS[front](llm, served)
    after = samples(served.url)
    assert prompt_tokens > 0 and generated > 0
    assert delta(before, after, "petrel_request_success_total") == 1
    assert delta(before, after, "petrel_prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "petrel_generation_tokens_total") == generated
    assert delta(before, after, "petrel_time_to_first_token_seconds_count") == 1
    assert delta(before, after, "petrel_time_per_output_token_seconds_count") == (1 if generated >= 2 else 0)
    assert delta(before, after, "petrel_e2e_request_latency_seconds_count") == 1
    assert delta(before, after, "petrel_e2e_request_latency_seconds_sum") > 0
    assert delta(before, after, "petrel_request_aborted_total") == 0


class PausedEngine:
    """The engine loop held between steps (a function waiting on its thread): requests queue but none runs, so one
    is sure to be in flight when it is given up on."""

    def __init__(self, llm):
        self._gate = threading.Event()
        self._thread = threading.Thread(target=llm.engine.call, args=(lambda core: self._gate.wait(WAIT),))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._gate.set()
        self._thread.join()


def test_requests_given_up_over_grpc_and_the_llm_api_count_as_aborted(llm, served):
    trtllm_in_flight, vllm_in_flight = served.trtllm_server.servicer.in_flight, served.vllm_server.servicer.in_flight
    before = samples(served.url)
    with PausedEngine(llm):
        # the client cancels its call
        cancelled = served.trtllm.Generate(_trtllm_request("m-cancel", 200), timeout=WAIT)
        wait_until(lambda: "m-cancel" in trtllm_in_flight)
        cancelled.cancel()
        wait_until(lambda: "m-cancel" not in trtllm_in_flight)
        # an Abort RPC ends the call
        aborted = served.vllm.Generate(_vllm_request("m-abort", 200, stream=True), timeout=WAIT)
        wait_until(lambda: "m-abort" in vllm_in_flight)
        served.vllm.Abort(vpb.AbortRequest(request_ids=["m-abort"]))
        # the LLM API's own abort
        future = llm.generate_async(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        future.abort()
    assert all(r.complete.finish_reason == "abort" for r in aborted if r.HasField("complete"))
    assert future.result(timeout=WAIT).outputs[0].finish_reason == "cancelled"
    wait_until(lambda: llm.engine.num_unfinished_sequences == 0)
    after = samples(served.url)
    assert delta(before, after, "petrel_request_aborted_total") == 3
    assert delta(before, after, "petrel_request_success_total") == 0
    assert delta(before, after, "petrel_generation_tokens_total") == 0


def test_a_grpc_request_refused_for_room_counts_as_rejected(llm, served):
    url = served.url
    full = build_grpc_server(llm, MODEL, max_pending=0).start()  # every request is one too many
    try:
        with grpc.insecure_channel(f"127.0.0.1:{full.port}") as channel:
            before = samples(url)
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.TrtllmServiceStub(channel).Generate(_trtllm_request("m-full"), timeout=WAIT))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert delta(before, samples(url), "petrel_request_rejected_total") == 1
    finally:
        full.stop()


# ------------------------------------------------------------------------------------ disaggregated serving
SECRET = "test-kv-transfer-secret"


@pytest.fixture(scope="module")
def split(tiny, tokenizer_dir):
    """(prefill URL, decode URL, bytes of PROMPT's KV): a prefill and a decode instance, each behind its app."""
    common = dict(tokenizer=tokenizer_dir, kv_cache_memory=1 << 20, kv_transfer_secret=SECRET)
    prefill = LLM(tiny(2, False).path, kv_transfer_role="prefill", kv_transfer_timeout=1, **common)
    decode = LLM(
        tiny(2, False).path, kv_transfer_role="decode", kv_transfer_peers=[prefill.kv_transfer_endpoint], **common
    )
    cfg = decode.engine.model_config
    kv_bytes = cfg.num_hidden_layers * 2 * len(PROMPT) * cfg.num_key_value_heads * cfg.head_dim * 4
    try:
        with BackgroundServer(build_app(prefill, MODEL)) as p, BackgroundServer(build_app(decode, MODEL)) as d:
            yield p.url, d.url, kv_bytes
    finally:
        prefill.shutdown()
        decode.shutdown()


def _context_only(prefill_url: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 4, "disaggregated_params": {"request_type": "context_only"}}
    params = _post(prefill_url, "/v1/completions", body).json()["choices"][0]["disaggregated_params"]
    return dict(params, request_type="generation_only")


def _generation_only(decode_url: str, params: dict) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "disaggregated_params": params}
    return httpx.post(f"{decode_url}/v1/completions", json=body, timeout=WAIT, trust_env=False)


def test_a_split_counts_the_kv_handed_off_and_fetched(split):
    prefill_url, decode_url, kv_bytes = split
    p0, d0 = samples(prefill_url), samples(decode_url)
    params = _context_only(prefill_url)
    assert total(samples(prefill_url), "petrel_kv_transfer_pins_held") == 1  # waiting for its fetch
    r = _generation_only(decode_url, params)
    assert r.status_code == 200 and r.json()["usage"]["kv_transfer"]["bytes"] == kv_bytes
    p1, d1 = samples(prefill_url), samples(decode_url)
    assert delta(p0, p1, "petrel_kv_transfer_handoffs_total") == 1
    assert delta(p0, p1, "petrel_kv_transfer_handoff_bytes_total") == kv_bytes
    assert delta(p0, p1, "petrel_kv_transfer_handoff_seconds_count") == 1
    assert delta(p0, p1, "petrel_kv_transfer_handoff_seconds_sum") > 0
    assert total(p1, "petrel_kv_transfer_pins_held") == 0
    assert delta(d0, d1, "petrel_kv_transfer_fetches_total") == 1
    assert delta(d0, d1, "petrel_kv_transfer_fetch_bytes_total") == kv_bytes
    assert delta(d0, d1, "petrel_kv_transfer_fetch_seconds_count") == 1
    assert delta(d0, d1, "petrel_kv_transfer_fetch_seconds_sum") > 0
    # both halves of the split are requests too: one success on each side
    assert delta(p0, p1, "petrel_request_success_total") == 1 and delta(d0, d1, "petrel_request_success_total") == 1
    # a spent handle: the decode instance's fetch fails, the prefill instance refused it
    assert _generation_only(decode_url, params).status_code == 400
    p2, d2 = samples(prefill_url), samples(decode_url)
    assert delta(d1, d2, "petrel_kv_transfer_fetch_failures_total") == 1
    assert delta(p1, p2, "petrel_kv_transfer_handoff_failures_total") == 1
    assert delta(d1, d2, "petrel_kv_transfer_fetches_total") == 0
    assert delta(p1, p2, "petrel_kv_transfer_handoffs_total") == 0


def test_an_unfetched_pin_counts_as_expired(split):
    prefill_url, _, _ = split
    before = samples(prefill_url)
    _context_only(prefill_url)
    assert total(samples(prefill_url), "petrel_kv_transfer_pins_held") == 1
    wait_until(lambda: delta(before, samples(prefill_url), "petrel_kv_transfer_pins_expired_total") == 1)
    assert total(samples(prefill_url), "petrel_kv_transfer_pins_held") == 0
