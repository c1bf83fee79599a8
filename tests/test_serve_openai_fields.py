"""What real OpenAI clients send and call: the fields their SDKs add (accepted-and-ignored, or honoured), legacy
`functions`, GET /v1/models/{model}, unknown routes, prompt scoring with max_tokens 0, tool calls streamed
argument by argument, and a tool prompt with no example to copy. One app on the default model, in-process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from petrel.route.router import Router, prefix_of
from petrel.serve.app import build_app
from petrel.serve.chat_template import ChatTemplate
from petrel.serve.protocol import ACCEPTED_AND_IGNORED, OpenAIClientFields

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "name": {"type": "string"}},
        "required": ["city", "name"],
    },
}
CITY = {"name": "city_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}}}
TWO_CALLS = "\\n".join(rf'<tool_call>\n\{{"name": "{f}", "arguments": \{{\}}\}}\n</tool_call>' for f in "fg")


@pytest.fixture(scope="module")
def http(llm):
    with TestClient(build_app(llm, "petrel-test", max_n=4)) as client:
        yield client


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_completion_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def error(http, path: str, body: dict, status: int = 400) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()["error"]


# ------------------------------------------------------------------------------------------ fields


SDK_FIELDS = {
    "store": False,
    "metadata": {"run": "x"},
    "service_tier": "auto",
    "safety_identifier": "u-1",
    "user": "u-1",
    "verbosity": "low",
    "reasoning_effort": "low",
    "prompt_cache_key": "conversation-7",
    "modalities": ["text"],
    "parallel_tool_calls": True,
}


def test_sdk_fields_are_accepted_and_change_nothing(http):
    plain = chat(http)["choices"][0]["message"]["content"]
    assert plain and chat(http, **SDK_FIELDS)["choices"][0]["message"]["content"] == plain


def test_the_accepted_and_ignored_list_is_the_code_and_the_docs():
    assert set(ACCEPTED_AND_IGNORED) <= set(OpenAIClientFields.model_fields)
    page = (Path(__file__).resolve().parent.parent / "docs" / "serving" / "index.md").read_text(encoding="utf-8")
    section = page[page.index("**Accepted and ignored.**") :].split("\n\n")[0]
    assert sorted(re.findall(r"`(\w+)`", section.split(":")[1].split(".")[0])) == sorted(ACCEPTED_AND_IGNORED)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"service_tier": "gold"}, "service_tier"),
        ({"metadata": {"a": 1}}, "metadata.a"),
        ({"not_a_field": 1}, "not_a_field"),
        ({"function_call": "auto"}, "function_call"),
        ({"functions": [WEATHER], "tools": [{"type": "function", "function": WEATHER}]}, "functions"),
    ],
)
def test_values_petrel_cannot_honour_are_refused(http, body, param):
    err = error(http, "/v1/chat/completions", {"messages": USER, **body})
    assert err["param"] == param
    assert chat(http)["choices"][0]["message"]["content"]  # the server goes on


def test_prompt_cache_key_routes_requests_together():
    router = Router([f"http://b{i}" for i in range(8)])
    keyed = [prefix_of({"messages": [{"role": "user", "content": t}], "prompt_cache_key": "k"}) for t in "ab"]
    assert keyed[0] == keyed[1]
    backends = {router.candidates(prefix_of({"prompt": "x", "prompt_cache_key": f"key{i}"}))[0].url for i in range(32)}
    assert len(backends) > 1  # different keys spread over the backends
    assert prefix_of({"prompt": "abc"}) == "abc"  # without a key: the prompt


def test_legacy_functions_answer_with_function_call(http, client):
    body = dict(functions=[CITY], function_call={"name": "city_weather"}, max_completion_tokens=16)
    r = chat(http, **body)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == "city_weather" and json.loads(call["arguments"])["city"] in ("Oslo", "Rome")
    streamed = client.chat.completions.create(model="petrel-test", messages=USER, temperature=0, stream=True, **body)
    name, args, finish = "", "", None
    for chunk in streamed:
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        if delta.function_call:
            name += delta.function_call.name or ""
            args += delta.function_call.arguments or ""
    assert (name, args, finish) == ("city_weather", call["arguments"], "function_call")


def test_parallel_tool_calls_false_keeps_one_call(client):
    """The output is held to two calls (guided_regex): both reported, or with parallel_tool_calls=false the first."""
    kw = dict(
        model="petrel-test",
        messages=USER,
        tools=[{"type": "function", "function": {"name": name}} for name in "fg"],
        temperature=0,
        max_completion_tokens=64,
        extra_body={"guided_regex": TWO_CALLS},
    )
    calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["f", "g"]
    found: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kw, parallel_tool_calls=False, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            found[d.index] = found.get(d.index, "") + (d.function.name or "")
    assert found == {0: "f"}


# ------------------------------------------------------------------------------------------ routes


def test_retrieve_a_model_and_unknown_ones(client, http):
    card = client.models.retrieve("petrel-test")
    assert card.id == "petrel-test" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-5")
    assert err.value.body["code"] == "model_not_found" and "petrel-test" in err.value.body["message"]


def test_an_unsupported_route_says_so(http):
    err = error(http, "/v1/audio/speech", {"input": "hi"}, 404)
    assert "POST /v1/audio/speech" in err["message"] and "not a route petrel supports" in err["message"]
    assert err["code"] == "unsupported_route"
    assert http.get("/v1/nothing").json()["error"]["message"].startswith("GET /v1/nothing ")


# ------------------------------------------------------------------------------------------ completions


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt(llm, hf_model, http, stream):
    prompt = "The petrel is a seabird that"
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        (choice,) = [c for e in events for c in e["choices"]]
    else:
        (choice,) = r.json()["choices"]
        assert r.json()["usage"]["completion_tokens"] == 0
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    ids = llm.tokenizer(prompt)["input_ids"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-4)


def test_max_tokens_0_needs_echo_and_suffix_is_refused(http):
    assert error(http, "/v1/completions", {"prompt": "a", "max_tokens": 0})["param"] == "max_tokens"
    err = error(http, "/v1/completions", {"prompt": "def f(", "suffix": "return 1"})
    assert err["param"] == "suffix" and "fill-in-the-middle" in err["message"]


# ------------------------------------------------------------------------------------------ tools


def test_the_tool_prompt_has_no_example_values(llm):
    text = ChatTemplate(llm.tokenizer).render(USER, [{"type": "function", "function": WEATHER}])
    assert "<name>" not in text and "<city>" not in text
    assert text.count("<tool_call>") == 1 and '"name": "get_weather"' in text  # the format tag, the tool's schema


def test_tool_call_arguments_stream_in_fragments(client):
    kw = dict(
        model="petrel-test",
        messages=USER,
        tools=[{"type": "function", "function": WEATHER}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_completion_tokens=48,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    args = json.loads(whole.function.arguments)
    assert set(args) == {"city", "name"} and "<" not in json.dumps(args)
    deltas = [
        d
        for chunk in client.chat.completions.create(**kw, stream=True)
        for d in chunk.choices[0].delta.tool_calls or []
    ]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert len(rest) > 2 and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    assert "".join(d.function.arguments for d in rest) == whole.function.arguments
