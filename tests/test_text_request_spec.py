"""TextGenerationRequest's spec fields (MAX's request type) through LLM.generate, and FinishDetails' abort codes."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import httpx
import pytest

from petrel import SamplingParams, TextGenerationRequest
from petrel.engine.output_processor import RequestOutputProcessor
from petrel.model.tokenizer import chat_prompt
from petrel.outputs import FinishDetails, OutputChunk
from petrel.request_output_builder import RequestOutputBuilder
from petrel.text_request import MAX_REQUEST_PATH_CHARS

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris today?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _req(**kw) -> TextGenerationRequest:
    kw.setdefault("sampling_params", GREEDY)
    return TextGenerationRequest(request_id=kw.pop("request_id", "r"), **kw)


# ------------------------------------------------------------------------------------------- tools
# a regex that makes the model write one call (SmolLM2-135M answers in prose when left to choose)
CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}\n</tool_call>'


@pytest.mark.e2e
@pytest.mark.parametrize("forced", [False, True], ids=["auto", "regex_forced_call"])
def test_tools_render_and_parse_as_the_server_does(llm, forced):
    from petrel.guided_decoding import GuidedDecodingParams
    from petrel.serve import build_app
    from petrel.serve.server import BackgroundServer

    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": USER,
        "tools": [WEATHER_TOOL],
        "temperature": 0,
        "max_completion_tokens": 40,
        "return_token_ids": True,
    }
    params = SamplingParams(temperature=0, max_tokens=40)
    if forced:
        body["guided_regex"] = CALL_REGEX
        params = dataclasses.replace(params, guided_decoding=GuidedDecodingParams(regex=CALL_REGEX))
    with BackgroundServer(build_app(llm)) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120).json()
    out = llm.generate(_req(messages=USER, tools=[WEATHER_TOOL], sampling_params=params))
    # the same prompt token ids as the server, and they hold the tool listing (SmolLM2's template has no tools)
    assert out.prompt_token_ids == r["prompt_token_ids"]
    assert "get_weather" in out.prompt
    assert out.prompt_token_ids != chat_prompt(llm.tokenizer, USER)["prompt_token_ids"]
    co, choice = out.outputs[0], r["choices"][0]
    assert co.token_ids == choice["token_ids"]
    server_calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"].get("tool_calls") or []
    ]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in co.tool_calls]
    assert calls == server_calls
    assert all(c.type == "function" and c.id.startswith("call_") for c in co.tool_calls)
    if forced:
        assert len(calls) == 1 and calls[0][0] == "get_weather" and set(calls[0][1]) == {"city"}


def test_tool_calls_are_parsed_from_a_finished_sequence():
    def build(parse_tools: bool):
        b = RequestOutputBuilder("r", "p", [1, 2], SamplingParams(), str)
        b.parse_tools = parse_tools
        text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        b.apply(OutputChunk("r", 0, [5, 6], text[:20], None, 2, 2, 0))
        assert b.result().outputs[0].tool_calls is None  # not finished yet
        b.apply(OutputChunk("r", 0, [7], text[20:], "stop", 2, 3, 0, finish_details=FinishDetails("stop", 7)))
        return b.result().outputs[0]

    co = build(True)
    ((call),) = co.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert co.text.startswith("Sure.\n<tool_call>")  # the text stays as written
    assert build(False).tool_calls is None


@pytest.mark.e2e
def test_without_tools_nothing_changes(llm):
    out = llm.generate(_req(messages=USER))
    assert out.prompt_token_ids == chat_prompt(llm.tokenizer, USER)["prompt_token_ids"]
    assert out.outputs[0].tool_calls is None
    assert out.outputs[0].token_ids == llm.generate(out.prompt_token_ids, GREEDY).outputs[0].token_ids


def test_tools_need_messages_and_a_list_of_dicts():
    with pytest.raises(ValueError, match="tools"):
        _req(prompt="x", tools=[WEATHER_TOOL])
    with pytest.raises(ValueError, match="tools"):
        _req(messages=USER, tools=WEATHER_TOOL)
    assert _req(messages=USER, tools=[WEATHER_TOOL]).tools == [WEATHER_TOOL]


# ------------------------------------------------------------------------------------------- echo
@pytest.mark.e2e
def test_echo_prefixes_the_prompt_text_independent_of_logprobs(llm):
    plain = llm.generate("The capital of France is", GREEDY).outputs[0]
    out = llm.generate(_req(prompt="The capital of France is", echo=True))
    co = out.outputs[0]
    assert co.text == "The capital of France is" + plain.text
    assert co.token_ids == plain.token_ids and out.prompt_logprobs is None
    with_lp = llm.generate(_req(prompt="The capital of France is", echo=True, logprobs=2))
    assert with_lp.outputs[0].text == co.text
    assert len(with_lp.prompt_logprobs) == len(out.prompt_token_ids) and with_lp.prompt_logprobs[0] is None
    # streamed: the first update carries the prompt, the diffs add up to the same text
    pieces = [
        p.outputs[0].text_diff
        for p in llm.generate_async(_req(prompt="The capital of France is", echo=True), streaming=True)
    ]
    assert pieces[0].startswith("The capital of France is") and "".join(pieces) == co.text
    # token-id prompts echo their decoded text; without echo the text is the completion alone
    ids = llm.tokenizer("The capital of France is")["input_ids"]
    assert llm.generate(_req(prompt=ids, echo=True)).outputs[0].text == llm.tokenizer.decode(ids) + plain.text
    assert llm.generate(_req(prompt="The capital of France is")).outputs[0].text == plain.text
    assert out.prompt == "The capital of France is" and llm.generate(_req(prompt=ids)).prompt is None


# ------------------------------------------------------------------------------------------- timestamp, path
@pytest.mark.e2e
def test_timestamp_ns_sets_queue_time_and_request_path_is_logged_and_reported(llm, caplog):
    params = dataclasses.replace(GREEDY, max_tokens=2, return_perf_metrics=True)
    path = "/v1/completions?key=secret" + "x" * 300
    with caplog.at_level(logging.INFO, logger="petrel"):
        out = llm.generate(
            _req(prompt="Hi", sampling_params=params, timestamp_ns=time.time_ns() - 2_000_000_000, request_path=path)
        )
    m = out.outputs[0].request_perf_metrics
    assert 2.0 <= m.queue_time < 10.0 and m.ttft >= m.queue_time
    assert m.request_path == "/v1/completions"
    assert any("path=/v1/completions " in rec.getMessage() for rec in caplog.records)
    fresh = llm.generate(_req(prompt="Hi", sampling_params=params)).outputs[0].request_perf_metrics
    assert 0.0 <= fresh.queue_time < 2.0 and fresh.request_path == "/"
    long = llm.generate(_req(prompt="Hi", sampling_params=params, request_path="/" + "a" * 1000))
    assert len(long.outputs[0].request_perf_metrics.request_path) == MAX_REQUEST_PATH_CHARS
    with pytest.raises(ValueError, match="timestamp_ns"):
        _req(prompt="Hi", timestamp_ns=-1)
    with pytest.raises(ValueError, match="request_path"):
        _req(prompt="Hi", request_path=None)


@pytest.mark.e2e
def test_target_endpoint_is_refused_by_a_lone_engine(llm):
    with pytest.raises(ValueError, match="target_endpoint"):
        llm.generate(_req(prompt="Hi", target_endpoint="http://10.0.0.2:8000"))
    assert llm.generate(_req(prompt="Hi", target_endpoint=None)).outputs[0].token_ids  # unset: fine


# ------------------------------------------------------------------------------------------- images, videos
def test_images_videos_counts_and_refusal(llm):
    content = [{"type": "text", "text": "what is this"}, {"type": "image_url"}, {"type": "image"}, {"type": "video"}]
    r = _req(messages=[{"role": "user", "content": content}])
    assert (r.number_of_images, r.number_of_videos) == (2, 1)
    assert _req(prompt="x").number_of_images == 0
    decoded = object()
    assert _req(prompt="x", images=[b"png"], decoded_images=[decoded]).images_for_processing() == [decoded]
    assert _req(prompt="x", images=[b"png"]).images_for_processing() == [b"png"]
    for kw, name in (
        ({"images": [b"png"]}, "images"),
        ({"videos": [b"mp4"]}, "videos"),
        ({"decoded_images": [decoded]}, "decoded_images"),
    ):
        with pytest.raises(ValueError, match=name):
            llm.generate(_req(prompt="x", **kw))
    with pytest.raises(ValueError, match="image"):
        llm.generate(r)


# ------------------------------------------------------------------------------------------- dkv_cache_hint
def test_dkv_cache_hint_is_validated():  # the hint's shape: tests/test_kv_store.py
    hint = {"block_hashes": ["ab" * 32], "num_cached_tokens": 16}
    assert _req(prompt="x", dkv_cache_hint=hint).dkv_cache_hint == hint
    assert _req(prompt="x").dkv_cache_hint is None
    for bad in ([1], "hint", {1: "a"}, {"blocks": [1, 2]}):
        with pytest.raises(ValueError, match="dkv_cache_hint"):
            _req(prompt="x", dkv_cache_hint=bad)


# ------------------------------------------------------------------------------------------- FinishDetails
def test_finish_details_abort_codes():
    assert FinishDetails("abort", message="cancelled").code == "cancelled"
    assert FinishDetails("abort", message="timeout").code == "timeout"
    err = FinishDetails("abort", message="CUDA error: out of memory")
    assert (err.code, err.message) == ("error", "CUDA error: out of memory")
    stop = FinishDetails("stop", matched_token=2)
    assert stop.code is None and stop.matched_token == 2
    with pytest.raises(ValueError, match="code"):
        FinishDetails("abort", message="x", code="nope")
    (chunk,) = RequestOutputProcessor("r", None, [1], SamplingParams()).fail("the consumer failed")
    assert (chunk.finish_details.code, chunk.finish_details.message) == ("error", "the consumer failed")


@pytest.mark.e2e
def test_a_timed_out_request_finishes_with_the_timeout_code(llm):
    future = llm.generate_async("Count to a thousand:", SamplingParams(max_tokens=4000, ignore_eos=True), timeout=0.05)
    last = list(future.output_chunks())[-1]
    assert last.finish_reason == "abort"
    assert (last.finish_details.code, last.finish_details.message) == ("timeout", "timeout")


# ------------------------------------------------------------------------------------------- the other fields
@pytest.mark.e2e
def test_response_format_and_chat_template_options(llm):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    params = SamplingParams(temperature=0, max_tokens=40)
    out = llm.generate(_req(messages=USER, response_format=fmt, sampling_params=params)).outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text)["city"], str)
    plain = llm.generate(_req(messages=USER)).prompt_token_ids
    bare = llm.generate(_req(messages=USER, chat_template_options={"add_generation_prompt": False}))
    expected = chat_prompt(llm.tokenizer, USER, add_generation_prompt=False)["prompt_token_ids"]
    assert bare.prompt_token_ids == expected and len(expected) < len(plain)


@pytest.mark.e2e
def test_logprobs_diff_adds_up_to_the_final_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    diffs, last = [], None
    for last in llm.generate_async("The capital of France is", params, streaming=True):
        diffs.extend(last.outputs[0].logprobs_diff)
    final = last.outputs[0]
    assert len(diffs) == len(final.token_ids) == 6
    assert [d[t].logprob for d, t in zip(diffs, final.token_ids)] == [
        e[t].logprob for e, t in zip(final.logprobs, final.token_ids)
    ]
    assert all(len(d) >= 2 for d in diffs)
