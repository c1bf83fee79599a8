"""The server without a model: request conversion, chat templates, error bodies, /health, the OpenAPI document.

A fake LLM (the real default tokenizer, a fake engine loop) stands behind the app; nothing here loads real weights
(one health test runs the engine loop on the tiny random Llama).
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from petrel.engine.llm_engine import STEP_STALL_LIMIT, LLMEngine
from petrel.request_events import RequestEvents
from petrel.serve.app import build_app
from petrel.serve.chat_template import ChatTemplate, messages_for_template
from petrel.serve.errors import APIError
from petrel.serve.params import ServerLimits, build_sampling_params, parse_logit_bias, resolve_max_tokens
from petrel.serve.protocol import ChatMessage, CompletionRequest
from petrel.serve.streams import outputs_or_none


@pytest.fixture(scope="module")
def tokenizer():
    from petrel.model.loader import resolve_model
    from petrel.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


class FakeEngine:
    """A fake engine loop: answers engine.call like the loop does, or hangs (stuck, or busy in a long step) or raises
    (dead loop). `step_age`: seconds since the step now in progress began (None: not in a step)."""

    check_health = LLMEngine.check_health

    def __init__(self, mode="ok", step_age=None):
        self.mode = mode
        bm = SimpleNamespace(num_used_blocks=3, num_blocks=10)
        sched = SimpleNamespace(
            running=[1], waiting=[], prefix_queried_tokens=10, prefix_hit_tokens=4, num_preemptions=0
        )
        runner = SimpleNamespace(check_health=lambda: None)  # the model runner: its workers (if any) are alive
        self.core = SimpleNamespace(
            model_config=SimpleNamespace(vocab_size=49152),
            block_manager=bm,
            scheduler=sched,
            runner=runner,
            num_draft_tokens=8,
            num_accepted_tokens=6,
            encoder_counters=lambda: (5, 2, 0.25),  # a vision model's encoder: images encoded, cache hits, seconds
        )
        self.max_model_len = 64
        self._stopped = threading.Event()
        self._dead = None  # LLMEngine's cause of a dead loop (None: alive)
        self._thread = SimpleNamespace(is_alive=lambda: mode != "dead")
        self.step_started = None if step_age is None else time.monotonic() - step_age
        self.events = RequestEvents()

    def call(self, fn, timeout=30.0):
        if self.mode == "hung":
            threading.Event().wait(timeout)
            raise TimeoutError("the engine loop did not answer in time")
        if self.mode == "dead":
            raise RuntimeError("the engine has been shut down")
        return fn(self.core)


def fake_llm(tokenizer, mode="ok", step_age=None):
    return SimpleNamespace(
        tokenizer=tokenizer, engine=FakeEngine(mode, step_age), config=SimpleNamespace(model=None, max_num_seqs=4)
    )


LIMITS = ServerLimits(max_model_len=100, vocab_size=1000, max_n=4)


# ---------------------------------------------------------------------------------------- request conversion


def test_completion_request_to_sampling_params():
    req = CompletionRequest(
        prompt="hi",
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        n=2,
        stop="\n",
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        logit_bias={"10": -5},
        top_k=3,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[4],
        skip_special_tokens=False,
    )
    p = build_sampling_params(req, max_tokens=5, limits=LIMITS, logprobs=2)
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 5, 0.5, 0.9, 3, 0.05)
    assert (p.stop, p.seed, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (["\n"], 7, 0.1, 0.2, 1.1)
    assert (p.logit_bias, p.min_tokens, p.ignore_eos, p.stop_token_ids, p.skip_special_tokens) == (
        {10: -5.0},
        2,
        True,
        [4],
        False,
    )
    assert p.logprobs == 2 and p.return_perf_metrics
    defaults = build_sampling_params(CompletionRequest(prompt="x"), max_tokens=16, limits=LIMITS, logprobs=None)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.n) == (1.0, 1.0, 0, 1)


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(n=5), "n"),
        (dict(logit_bias={"abc": 1.0}), "logit_bias"),
        (dict(logit_bias={"5000": 1.0}), "logit_bias"),
        (dict(logit_bias={"-1": 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 101.0}), "logit_bias"),
        (dict(min_tokens=9), "min_tokens"),
        (dict(top_k=-5), "top_k"),
        (dict(stop_token_ids=[5000]), "stop_token_ids"),
        (dict(stream_options={"include_usage": True}), "stream_options"),
    ],
)
def test_bad_values_name_their_field(fields, param):
    with pytest.raises(APIError) as err:
        build_sampling_params(CompletionRequest(prompt="x", **fields), max_tokens=8, limits=LIMITS, logprobs=None)
    assert err.value.status == 400 and err.value.param == param


def test_max_tokens_must_fit_the_context():
    assert resolve_max_tokens(None, 16, 90, LIMITS, "max_tokens") == 10  # the default is capped
    assert resolve_max_tokens(None, None, 30, LIMITS, "max_tokens") == 70  # chat: all that is left
    assert resolve_max_tokens(70, None, 30, LIMITS, "max_tokens") == 70
    with pytest.raises(APIError) as err:
        resolve_max_tokens(71, None, 30, LIMITS, "max_completion_tokens")
    assert err.value.param == "max_completion_tokens"
    assert parse_logit_bias({"1": 2}, 10) == {1: 2.0}


# ---------------------------------------------------------------------------------------- chat templates

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "And you?"},
]


def test_sandboxed_template_renders_like_transformers(tokenizer):
    template = ChatTemplate(tokenizer)
    for add in (True, False):
        for messages in (CONVERSATION, CONVERSATION[1:2]):
            ref = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert template.render(messages, add_generation_prompt=add) == ref


def test_template_override_and_sandbox(tokenizer):
    template = ChatTemplate(tokenizer, "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert template.render(CONVERSATION[1:3]) == "[user] Hi!\n[assistant] Hello.\n"
    evil = ChatTemplate(tokenizer, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(APIError) as err:
        evil.render(CONVERSATION)
    assert err.value.status == 400 and err.value.param == "messages"
    raising = ChatTemplate(tokenizer, "{{ raise_exception('no system messages') }}")
    with pytest.raises(APIError, match="no system messages"):
        raising.render(CONVERSATION)


def test_continue_final_message(tokenizer):
    template = ChatTemplate(tokenizer)
    text = template.render(CONVERSATION[:3], add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello.")
    with pytest.raises(APIError) as err:
        template.render(CONVERSATION, add_generation_prompt=False, continue_final_message=True)
    assert err.value.param == "continue_final_message"


def test_tools_go_into_the_system_prompt_when_the_template_has_none(tokenizer):
    template = ChatTemplate(tokenizer)
    assert not template.supports_tools
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = messages_for_template(
        [
            ChatMessage(
                role="user", content=[{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]
            ),
            ChatMessage(
                role="assistant",
                tool_calls=[{"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
            ),
            ChatMessage(role="tool", tool_call_id="call_1", content="-3 C"),
        ],
        template.supports_tools,
    )
    text = template.render(messages, tools)
    assert text.startswith("<|im_start|>system\nYou may call functions")
    assert '"name": "get_weather"' in text
    assert "<|im_start|>user\nWeather\nin Oslo?<|im_end|>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n-3 C<|im_end|>" in text


def test_image_parts_are_refused():
    with pytest.raises(APIError) as err:
        messages_for_template(
            [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])], False
        )
    assert err.value.param == "messages.0.content.0.type"


# ---------------------------------------------------------------------------------------- the app, faked engine


@pytest.mark.parametrize(
    "mode, step_age, status",
    [
        ("ok", None, 200),  # idle: the loop answers the round trip
        ("hung", 0.0, 200),  # in a step: healthy without a round trip (this loop would not answer)
        ("hung", None, 503),  # not in a step and not answering: stuck
        ("hung", STEP_STALL_LIMIT + 1, 503),  # in a step older than the stall limit, not answering: stuck
        ("dead", None, 503),  # the loop thread has ended
        ("dead", 0.0, 503),  # ... whatever step stamp it left behind
    ],
)
def test_health_checks_the_engine_loop(tokenizer, mode, step_age, status):
    app = build_app(fake_llm(tokenizer, mode, step_age), health_timeout=0.3)
    with TestClient(app) as client:
        t0 = time.monotonic()
        r = client.get("/health")
        assert r.status_code == status
        assert time.monotonic() - t0 < 5
        if status == 503:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        else:
            assert r.json() == {"status": "ok"}


def test_health_answers_at_once_during_a_long_step(tokenizer):
    app = build_app(fake_llm(tokenizer, "hung", step_age=30.0), health_timeout=10.0)
    with TestClient(app) as client:
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - t0 < 1.0  # not the 10 s a round trip would wait


def test_check_health_on_a_real_engine(tiny, tokenizer, tmp_path):
    """The tiny random Llama's engine loop (the default tokenizer beside it): healthy idle, after generating, at once
    during a slow step and after a failed one; not once shut down."""
    from petrel import LLM, SamplingParams

    tokenizer.save_pretrained(tmp_path)
    llm = LLM(tiny(2, False).path, tokenizer=str(tmp_path), kv_cache_memory=1 << 20)
    try:
        llm.engine.check_health()
        out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 8
        assert llm.engine.step_started is None
        llm.engine.check_health()
        step = llm.engine.core.step  # now a slow step: check_health must not wait behind it
        llm.engine.core.step = lambda: time.sleep(1.0) or step()
        worker = threading.Thread(
            target=llm.generate, args=([5, 6, 7], SamplingParams(max_tokens=1)), kwargs={"use_tqdm": False}
        )
        worker.start()
        for _ in range(1000):
            if llm.engine.step_started is not None:
                break
            time.sleep(0.01)
        assert llm.engine.step_started is not None
        t0 = time.monotonic()
        llm.engine.check_health(timeout=10.0)
        assert time.monotonic() - t0 < 0.5
        worker.join()
        llm.engine.core.step = lambda: 1 / 0  # a failed step fails its request; the loop goes on, stamp cleared
        with pytest.raises(RuntimeError, match="engine error: division by zero"):
            llm.generate([5, 6, 7], SamplingParams(max_tokens=1), use_tqdm=False)
        assert llm.engine.step_started is None
        llm.engine.core.step = step
        llm.engine.check_health()
        assert len(llm.generate([5, 6], SamplingParams(max_tokens=2), use_tqdm=False).outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        llm.engine.check_health()


class FakeFuture:
    """A request future that resolves to `value`, raises `error`, or never finishes."""

    def __init__(self, value=None, error=None, never=False):
        self.value, self.error, self.never, self.aborted = value, error, never, False

    def done(self):
        return not self.never

    def abort(self):
        self.aborted = True

    def __await__(self):
        return self._result().__await__()

    async def _result(self):
        if self.never:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        return self.value


def test_outputs_or_none_maps_a_gone_client_and_engine_errors():
    async def connected():
        await asyncio.Event().wait()

    async def gone():
        return {"type": "http.disconnect"}

    state = SimpleNamespace()
    assert asyncio.run(
        outputs_or_none(state, SimpleNamespace(receive=connected), [FakeFuture("a"), FakeFuture("b")])
    ) == ["a", "b"]
    stuck = FakeFuture(never=True)
    assert asyncio.run(outputs_or_none(state, SimpleNamespace(receive=gone), [stuck])) is None  # the caller's 499
    assert stuck.aborted  # (RequestFuture.abort counts it as aborted)
    failed = [FakeFuture(error=RuntimeError("request 3 failed: engine error: boom"))]
    with pytest.raises(APIError) as err:
        asyncio.run(outputs_or_none(state, SimpleNamespace(receive=connected), failed))
    assert err.value.status == 500 and err.value.message.endswith("boom") and not failed[0].aborted


def test_metrics_read_engine_state(tokenizer):
    with TestClient(build_app(fake_llm(tokenizer))) as client:
        text = client.get("/metrics").text
    assert 'petrel_kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"} 0.3' in text
    assert 'petrel_prefix_cache_hit_rate{model_name="SmolLM2-135M-Instruct"} 0.4' in text
    assert 'petrel_num_requests_running{model_name="SmolLM2-135M-Instruct"} 1.0' in text
    assert 'petrel_spec_decode_num_draft_tokens{model_name="SmolLM2-135M-Instruct"} 8.0' in text
    assert 'petrel_spec_decode_acceptance_rate{model_name="SmolLM2-135M-Instruct"} 0.75' in text
    assert 'petrel_encoder_images_encoded_total{model_name="SmolLM2-135M-Instruct"} 5.0' in text
    assert 'petrel_encoder_cache_hits_total{model_name="SmolLM2-135M-Instruct"} 2.0' in text
    assert 'petrel_encoder_seconds_total{model_name="SmolLM2-135M-Instruct"} 0.25' in text
    for name in (
        "petrel_request_success_total",
        "petrel_prompt_tokens_total",
        "petrel_generation_tokens_total",
        "petrel_time_to_first_token_seconds",
        "petrel_time_per_output_token_seconds",
        "petrel_e2e_request_latency_seconds",
        "petrel_num_requests_waiting",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in text


def test_api_key_and_error_shapes(tokenizer):
    with TestClient(build_app(fake_llm(tokenizer), api_key="sekrit"), raise_server_exceptions=False) as client:
        for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = client.get(path) if path == "/v1/models" else client.post(path, json={})
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = {"Authorization": "Bearer sekrit"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
        assert client.get("/health").status_code == 200  # not behind the key
        r = client.post("/tokenize", json={"prompt": "Hello world"}, headers=ok)
        assert r.status_code == 200 and r.json()["tokens"] == tokenizer("Hello world")["input_ids"]
        r = client.post("/detokenize", json={"tokens": r.json()["tokens"]}, headers=ok)
        assert r.json() == {"prompt": "Hello world"}
        r = client.get("/v1/nothing", headers=ok)
        assert r.status_code == 404 and "error" in r.json()


def test_openapi_document_describes_the_api(tokenizer):
    with TestClient(build_app(fake_llm(tokenizer), api_key="k")) as client:
        doc = client.get("/openapi.json").json()
    paths = doc["paths"]
    for path, method in (
        ("/v1/completions", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/health", "get"),
        ("/metrics", "get"),
        ("/tokenize", "post"),
        ("/detokenize", "post"),
    ):
        assert method in paths[path], path
    schemas = doc["components"]["schemas"]
    op = paths["/v1/chat/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert {
        "messages",
        "tools",
        "tool_choice",
        "response_format",
        "top_logprobs",
        "max_completion_tokens",
        "chat_template_kwargs",
        "continue_final_message",
        "top_k",
        "cache_salt",
    } <= set(schemas["ChatCompletionRequest"]["properties"])
    assert {"prompt", "echo", "logprobs", "stream_options", "logit_bias", "min_tokens", "ignore_eos"} <= set(
        schemas["CompletionRequest"]["properties"]
    )
    assert schemas["CompletionRequest"].get("additionalProperties") is False
    assert op.get("security"), "the API key scheme is documented"
    assert "ChatCompletionChunk" in schemas and "Usage" in schemas
    try:
        from openapi_spec_validator import validate
    except ImportError:
        return
    validate(doc)  # every $ref resolves, the document is valid OpenAPI
