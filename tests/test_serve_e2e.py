"""The real server on 127.0.0.1 with the default model, driven by the official openai client (sync and async).

Oracles: the server's greedy output equals `llm.generate` on the same prompt ids; streamed equals non-streamed;
tool calls equal the parser run on the engine's own greedy output; free KV blocks return to their baseline.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import openai
import pytest

from petrel import SamplingParams
from petrel.serve import build_app, tool_grammar
from petrel.serve.chat import TOOL_CALL_STOP
from petrel.serve.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    CompletionStreamResponse,
)
from petrel.serve.server import BackgroundServer
from petrel.serve.tool_grammar import named_call_grammar
from petrel.serve.tool_parser import parse_all
from tests.conftest import free_blocks

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(build_app(llm, max_n=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(llm, prompt, max_tokens, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw)).outputs[0]


def metric(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for_baseline(llm, baseline, seconds=15.0):
    deadline = time.monotonic() + seconds
    while free_blocks(llm) != baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    return free_blocks(llm)


# ------------------------------------------------------------------------------------------- completions


def test_completion_greedy_equals_the_engine(llm, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    CompletionResponse.model_validate(r.model_dump())
    ref = greedy(llm, prompt, 12)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(llm.tokenizer(prompt)["input_ids"])
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL


def test_completion_echo_and_logprobs(llm, client):
    prompt = "The capital of France is"
    prompt_ids = llm.tokenizer(prompt)["input_ids"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=3)
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=3))
    choice = r.choices[0]
    assert choice.text == prompt + ref.outputs[0].text
    lp = choice.logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 5 and len(lp.token_logprobs) == n + 5 and len(lp.text_offset) == n + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    all_ids = prompt_ids + ref.outputs[0].token_ids
    entries = ref.prompt_logprobs[1:] + ref.outputs[0].logprobs
    for i, (tok, entry) in enumerate(zip(all_ids[1:], entries), start=1):
        assert lp.token_logprobs[i] == pytest.approx(entry[tok].logprob, abs=1e-5)
        assert lp.tokens[i] == llm.tokenizer.decode([tok])
        assert 1 <= len(lp.top_logprobs[i]) <= 3
    for i in range(n, n + 5):  # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completion_batch_of_prompts_and_token_ids(llm, client):
    prompts = ["Hello, my name is", "List three colors:"]
    ids = llm.tokenizer("def fibonacci(n):")["input_ids"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [greedy(llm, p, 6).text for p in prompts]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == greedy(llm, ids, 6).text
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert [c.text for c in r.choices] == [greedy(llm, ids, 4).text, greedy(llm, ids[:3], 4).text]


def test_stop_and_seed(llm, client):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[" 9"])
    ref = greedy(llm, prompt, 30, stop=[" 9"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref.text and " 9" not in r.choices[0].text
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds should not all give the same sample"


def test_n2(client):
    kw = dict(model=MODEL, prompt="Tell me a joke:", max_tokens=10, temperature=1.0, n=2, seed=7)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    stream = client.completions.create(stream=True, **kw)
    texts = {0: "", 1: ""}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in r.choices}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi"}],
        max_completion_tokens=8,
        n=2,
        seed=3,
        temperature=1.0,
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_usage_in_the_last_stream_chunk(client):
    stream = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 6
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    # no include_usage: no usage anywhere
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_sse_tail_is_exactly_openai(server):
    body = {
        "prompt": "Hi",
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage_only = json.loads(events[-2][6:])
    assert usage_only["choices"] == [] and usage_only["usage"]["completion_tokens"] == 3
    finish = json.loads(events[-3][6:])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"] is None
    for e in events[:-1]:
        CompletionStreamResponse.model_validate_json(e[6:])


# ------------------------------------------------------------------------------------------- chat


def test_chat_with_system_prompt_equals_the_engine(llm, client):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    ChatCompletionResponse.model_validate(r.model_dump())
    prompt = llm.apply_chat_template(messages)
    assert "You are a terse assistant." in prompt["prompt"]
    ref = greedy(llm, prompt["prompt_token_ids"], 16)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == len(prompt["prompt_token_ids"])
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"


def test_chat_logprobs(llm, client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    ref = llm.generate(
        llm.apply_chat_template(messages)["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    ).outputs[0]
    for item, tok, entry in zip(content, ref.token_ids, ref.logprobs):
        assert item.logprob == pytest.approx(entry[tok].logprob, abs=1e-5)
        assert item.token == llm.tokenizer.decode([tok])
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)
    assert bytes(b for item in content for b in item.bytes).decode() == r.choices[0].message.content


STREAM_PROMPTS = [
    "Hello, my name is",
    "Write a poem about the sea.",
    "Repeat after me: 你好世界，你好世界，你好世界，",
    "Emoji list: 🎉🦜🎉🦜🎉🦜",
    "Question: What is 17 times 23? Answer:",
    "The history of Rome " * 6,
]


def _cold(kw: dict) -> dict:
    """A fresh cache_salt: the prefix cache cannot make usage.cached_tokens depend on which request ran first."""
    extra = dict(kw.pop("extra_body", {}), cache_salt=f"stream-eq-{next(_SALTS)}")
    return dict(kw, extra_body=extra)


_SALTS = itertools.count()


async def _collect_completion(aclient, prompt, stream, **kw):
    kw = _cold(kw)
    if not stream:
        r = await aclient.completions.create(model=MODEL, prompt=prompt, stream=False, **kw)
        c = r.choices[0]
        return c.text, c.model_extra["token_ids"], c.finish_reason, r.usage.model_dump()
    text, toks, finish, usage = "", [], None, None
    async for ch in await aclient.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if ch.usage is not None:
            usage = ch.usage.model_dump()
        for c in ch.choices:
            assert "\ufffd" not in c.text, "a broken multi-byte character was streamed"
            text += c.text
            toks += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    return text, toks, finish, usage


async def _collect_chat(aclient, content, stream, **kw):
    kw = _cold(kw)
    messages = [{"role": "user", "content": content}]
    if not stream:
        r = await aclient.chat.completions.create(model=MODEL, messages=messages, stream=False, **kw)
        c = r.choices[0]
        return c.message.content, c.model_extra["token_ids"], c.finish_reason, r.usage.model_dump()
    text, toks, finish, usage = "", [], None, None
    async for ch in await aclient.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    ):
        ChatCompletionChunk.model_validate(ch.model_dump())
        if ch.usage is not None:
            usage = ch.usage.model_dump()
        for c in ch.choices:
            assert "\ufffd" not in (c.delta.content or "")
            text += c.delta.content or ""
            toks += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    return text, toks, finish, usage


def test_stream_equals_non_stream(aclient):
    kw = dict(max_tokens=20, temperature=0, extra_body={"return_token_ids": True})

    async def run():
        jobs = []
        for p in STREAM_PROMPTS:
            jobs += [
                _collect_completion(aclient, p, False, **kw),
                _collect_completion(aclient, p, True, **kw),
                _collect_chat(aclient, p, False, **kw),
                _collect_chat(aclient, p, True, **kw),
            ]
        jobs += [
            _collect_completion(
                aclient,
                "Count: 1, 2, 3,",
                s,
                max_tokens=20,
                temperature=0,
                stop=[" 7"],
                extra_body={"return_token_ids": True},
            )
            for s in (False, True)
        ]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i in range(0, len(results), 2):
        plain, streamed = results[i], results[i + 1]
        assert streamed == plain, f"pair {i // 2}"
        assert plain[3]["completion_tokens"] == len(plain[1])
        assert plain[3]["prompt_tokens_details"]["cached_tokens"] == 0
    assert any(any(ord(ch) > 0x2000 for ch in r[0]) for r in results), "some output has multi-byte characters"


# ------------------------------------------------------------------------------------------- tools


def _tool_call_oracle(llm, prompt_ids, max_tokens, prefill, guided=None):
    """What the server should report: the engine's own greedy output (under the same grammar), through the
    same parser."""
    out = greedy(llm, prompt_ids, max_tokens, stop=[TOOL_CALL_STOP], guided_decoding=guided)
    return [(c.name, json.loads(c.arguments)) for c in parse_all(out.text, prefix=prefill).calls]


def test_tool_call_round_trip(llm, client):
    messages = [{"role": "user", "content": "What is the weather in Paris today?"}]
    kw = dict(
        model=MODEL,
        tools=[WEATHER_TOOL],
        max_completion_tokens=40,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"return_token_ids": True},
    )
    r = client.chat.completions.create(messages=messages, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    prefill = '<tool_call>\n{"name": "get_weather", "arguments":'
    guided = named_call_grammar(WEATHER_TOOL["function"]["parameters"]) if tool_grammar.available() else None
    assert _tool_call_oracle(llm, r.model_extra["prompt_token_ids"], 40, prefill, guided) == [("get_weather", args)]

    # the same request streamed: tool-call deltas that add up to the same call
    calls, finish = {}, None
    for ch in client.chat.completions.create(messages=messages, stream=True, **kw):
        for c in ch.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or d.id
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", args)]

    # send the result back: the model answers in text
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})},
    ]
    r2 = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_completion_tokens=24,
        temperature=0,
    )
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].finish_reason in ("stop", "length")
    assert r2.choices[0].message.content


def test_required_tool_choice_and_auto(llm, client):
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_completion_tokens=40,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    # auto: whatever the model writes, the response is either text or parsed calls, never both missing
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_completion_tokens=30, temperature=0
    )
    m = r.choices[0].message
    assert (m.tool_calls and r.choices[0].finish_reason == "tool_calls") or (m.content and not m.tool_calls)


# ------------------------------------------------------------------------------------------- disconnects


def test_disconnect_while_streaming_aborts(llm, server):
    baseline = free_blocks(llm)
    aborted = metric(server, "petrel_request_aborted_total")
    body = {
        "prompt": "Write a very long essay about the ocean.",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        assert free_blocks(llm) < baseline  # the request holds blocks while it runs
    assert wait_for_baseline(llm, baseline) == baseline
    assert metric(server, "petrel_request_aborted_total") == aborted + 1
    llm.engine.call(lambda core: core.block_manager.check_integrity())


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_during_prefill_or_decode_non_streaming_aborts(llm, server, stream):
    baseline = free_blocks(llm)
    long_prompt = list(range(1000, 3000))  # a 2,000-token prompt: its prefill takes a while on CPU
    for body, wait in (
        ({"prompt": long_prompt, "max_tokens": 3000, "ignore_eos": True}, 0.3),  # prefill
        ({"prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True}, 1.5),
    ):  # decode
        body["stream"] = stream
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=wait) as r:
                for _ in r.iter_lines():
                    raise httpx.ReadTimeout("disconnect now")  # streaming: leave at the first event
        assert wait_for_baseline(llm, baseline) == baseline
        assert llm.engine.call(lambda core: len(core.scheduler.running) + len(core.scheduler.waiting)) == 0


# ------------------------------------------------------------------------------------------- auth, errors, metrics


def test_api_key(llm):
    with BackgroundServer(build_app(llm, api_key="s3cret")) as srv:
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert httpx.post(f"{srv.url}/v1/chat/completions", json={}).status_code == 401
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == [MODEL]
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (path, body (dict, or bytes sent as JSON), status, param)
    (CMPL, b"{not json", 400, None),
    (CMPL, b"[1, 2]", 400, None),
    (CMPL, {"prompt": 5}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "temperature": 5}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    (CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (CMPL, {"prompt": list(range(100, 8400)), "max_tokens": 1}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": 9000}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "n": 50}, 400, "n"),
    (CMPL, {"prompt": "hi", "logit_bias": {"dog": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": [1, 2, 99999999]}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CMPL, {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [10**8]}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "top_k": -7}, 400, "top_k"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        400,
        "response_format",
    ),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    (
        CHAT,
        {"messages": USER, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        400,
        "tool_choice",
    ),
    (CHAT, {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": 9000}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 9000}, 400, "max_tokens"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content.0.type",
    ),
    (CHAT, {"messages": USER, "continue_final_message": True}, 400, "continue_final_message"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages"),
    (CHAT, {"messages": USER, "functions": [{"name": "f"}], "tools": [WEATHER_TOOL]}, 400, "functions"),
    (CHAT, {"messages": USER, "n": 0}, 400, "n"),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize(
    "path, body, status, param",
    BAD_REQUESTS,
    ids=[f"{i}-{p.rsplit('/', 1)[-1]}-{s}" for i, (p, _, s, _x) in enumerate(BAD_REQUESTS)],
)
def test_bad_requests(server, path, body, status, param):
    url = f"{server.url}{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_server_keeps_serving_after_bad_requests(llm, server, client):
    baseline = free_blocks(llm)
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405
    r = client.completions.create(model=MODEL, prompt="Still alive?", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert free_blocks(llm) == baseline


def test_tokenize_detokenize(llm, server):
    messages = [{"role": "user", "content": "Hello there"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == llm.apply_chat_template(messages)["prompt_token_ids"] and r["count"] == len(r["tokens"])
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()[
        "prompt"
    ] == llm.tokenizer.decode(r["tokens"])


def test_metrics_count_requests(server, client):
    client.completions.create(model=MODEL, prompt="Metrics please", max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    label = f'model_name="{MODEL}"'
    assert samples[f'petrel_request_success_total{{finished_reason="length",{label}}}'] >= 1
    assert samples[f"petrel_generation_tokens_total{{{label}}}"] >= 4
    assert samples[f"petrel_prompt_tokens_total{{{label}}}"] >= 3
    assert samples[f"petrel_time_to_first_token_seconds_count{{{label}}}"] >= 1
    assert samples[f"petrel_e2e_request_latency_seconds_count{{{label}}}"] >= 1
    assert samples[f"petrel_engine_up{{{label}}}"] == 1
    assert 0 <= samples[f"petrel_kv_cache_usage_perc{{{label}}}"] <= 1
    assert 0 <= samples[f"petrel_prefix_cache_hit_rate{{{label}}}"] <= 1


def test_w3_client_smoke(server):
    from petrel.bench import make_w2_prompts
    from petrel.bench.serve import run_client

    result = asyncio.run(run_client(server.url, MODEL, make_w2_prompts(3, 40), max_tokens=4, concurrency=2))
    assert result["valid"] and result["output_tokens"] == 12 and result["ttft_p50_s"] > 0


def test_bench_serve_sweep_writes_json_and_a_plot(server, tmp_path):
    pytest.importorskip("matplotlib")
    from petrel.cli import main

    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(
        [
            "bench",
            "serve",
            "--url",
            server.url,
            "--model",
            MODEL,
            "--num-prompts",
            "3",
            "--max-tokens",
            "4",
            "--sweep",
            "1,3",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    runs = json.loads(out.read_text())["sweep"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    assert all(r["valid"] and r["output_tokens"] == 12 and r["tpot_p50_s"] > 0 for r in runs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
