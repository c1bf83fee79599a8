"""The openai SDK's Responses API (`client.responses`) against petrel serve: text, a function tool round trip,
structured output, streaming events, the response store, and the errors for what petrel cannot honour."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
REPORT = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
REPORT_FORMAT = {"format": {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}}


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_text_equals_chat_completions(client):
    """instructions + input run as the chat endpoint's system + user messages: the same greedy text and usage."""
    r = client.responses.create(
        model=MODEL, instructions="You are terse.", input="Name a color.", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
        max_completion_tokens=12,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finish = chat.choices[0].finish_reason
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
        ("incomplete", "max_output_tokens") if finish == "length" else ("completed", None)
    )
    assert r.instructions == "You are terse." and r.max_output_tokens == 12


def test_function_tool_round_trip(client):
    """A forced call -> function_call item; its output back via previous_response_id, or the whole conversation
    as input items: both continue to the same structured answer."""
    first = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sunny": true}'}
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        tool_choice="none",
        text=REPORT_FORMAT,
        max_output_tokens=40,
        temperature=0,
    )
    assert chained.previous_response_id == first.id and chained.output[0].type == "message"
    jsonschema.validate(json.loads(chained.output_text), REPORT)
    whole = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            result,
        ],
        tools=[WEATHER],
        tool_choice="none",
        text=REPORT_FORMAT,
        max_output_tokens=40,
        temperature=0,
    )
    assert whole.output_text == chained.output_text
    assert whole.usage.input_tokens == chained.usage.input_tokens


def _events(client, **kw):
    """The raw events of a streamed response, and the response the last one carries."""
    events = list(client.responses.create(model=MODEL, stream=True, **kw))
    return events, events[-1].response


def test_stream_text_events(client):
    kw = dict(input="Write one sentence about the sea.", max_output_tokens=16, temperature=0)
    events, final = _events(client, **kw)
    plain = client.responses.create(model=MODEL, **kw)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text == final.output_text
    assert events[-4].text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens and final.id == events[0].response.id
    assert events[0].response.status == "in_progress"


def test_stream_function_call_events(client):
    events, final = _events(
        client,
        input="What is the weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    types = [e.type for e in events]
    assert types[0:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    (call,) = final.output
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "get_weather" and added.id == call.id == done.id
    assert "".join(e.delta for e in events[3:-3]) == events[-3].arguments == call.arguments == done.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_store_retrieve_and_store_false(client, served):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    gone = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=gone.id)
    assert err.value.body["param"] == "previous_response_id"


REFUSED = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [dict(WEATHER, name="bad name")]}, "tools[0]"),
    ({"frobnicate": 1}, None),
]


def test_refused_fields_name_themselves(served):
    for body, param in REFUSED:
        r = httpx.post(f"{served}/v1/responses", json={"model": MODEL, "input": "Hi", **body})
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param if param is not None else "frobnicate" in error["message"], (body, error)
    ok = httpx.post(f"{served}/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2


def _aborted(served) -> float:
    for line in httpx.get(f"{served}/metrics").text.splitlines():
        if line.startswith("petrel_request_aborted_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError("petrel_request_aborted_total")


def test_client_gone_mid_stream_aborts_and_frees_blocks(llm, served):
    def used_blocks() -> int:  # held by requests (blocks only the prefix cache keeps count as free)
        return llm.engine.call(lambda core: core.block_manager.num_used_blocks)

    # start from an engine that holds nothing: an earlier test's request finishing or letting go of its blocks
    # while this one takes its own left the free count unchanged mid-stream (seen twice in CI)
    deadline = time.monotonic() + 15
    while (llm.engine.num_unfinished_requests or used_blocks()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.engine.num_unfinished_requests == 0 and used_blocks() == 0
    aborted = _aborted(served)
    # greedy (sampled, the model may end the essay before the client hangs up): more than 400 tokens
    body = {
        "input": "Write a very long essay about the ocean.",
        "max_output_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{served}/v1/responses", json=body, timeout=60) as r:
        # the iterator is held: a `for` over a bare r.iter_lines() finalizes the generator at `break`, and httpcore
        # closes the connection then (GeneratorExit), so the server could abort before the checks below ran
        lines = r.iter_lines()
        deltas = 0
        for line in lines:
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
        assert llm.engine.num_unfinished_requests == 1, "the essay ended before the client hung up"
        assert used_blocks() > 0  # the request holds blocks while it runs
    deadline = time.monotonic() + 15
    while used_blocks() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert used_blocks() == 0 and _aborted(served) == aborted + 1


def test_the_store_is_a_bounded_lru():
    from petrel.serve.errors import APIError
    from petrel.serve.responses_output import ResponseStore, Stored

    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, Stored({"id": rid}, []))
    store.get("a")  # now the most recently used
    store.put("c", Stored({"id": "c"}, []))
    assert len(store) == 2 and store.get("a").response == {"id": "a"} and store.get("c").response == {"id": "c"}
    with pytest.raises(APIError) as err:
        store.get("b")
    assert err.value.status == 404 and err.value.param == "previous_response_id"
