"""The incremental tool-call parser: known outputs parse right, and any split of an output parses the same."""

from __future__ import annotations

import json
import random

import pytest

from petrel.serve.tool_parser import ParsedToolCall, ToolCallParser, parse_all

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'
T = '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'

CASES = [
    # (model output, expected content, expected [(name, arguments dict)])
    ("Hello there, no tools here.", "Hello there, no tools here.", []),
    ("  indented text with trailing space  ", "  indented text with trailing space  ", []),
    (f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", {"city": "Paris", "unit": "°C"})]),
    (
        f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>{T}</tool_call>\n",
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        f"<tool_call>{W}</tool_call> and then some text",
        " and then some text",
        [("get_weather", {"city": "Paris", "unit": "°C"})],
    ),
    (W, "", [("get_weather", {"city": "Paris", "unit": "°C"})]),
    (f"  [{W}, {T}]  ", "", [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {"tz": "Europe/Paris"})]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "f", "arguments": {"a": 1}} trailing', '{"name": "f", "arguments": {"a": 1}} trailing', []),
    ("<tool_call>{not json}</tool_call> rest", "<tool_call>{not json}</tool_call> rest", []),
    (f"<tool_call>\n{W}", "", [("get_weather", {"city": "Paris", "unit": "°C"})]),  # unclosed at the end
    ('<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),
    ("a < b and <tool is not a tag <tool_cal", "a < b and <tool is not a tag <tool_cal", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', "", [("f", {"x": 2})]),
    ("", "", []),
    ("\n\n", "\n\n", []),
]


def _run(pieces: list[str]) -> tuple[str, list[ParsedToolCall]]:
    parser = ToolCallParser()
    content, calls = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content += out.content
        calls += out.calls
    out = parser.finish()
    return content + out.content, calls + out.calls


@pytest.mark.parametrize("text, content, calls", CASES)
def test_parses_known_outputs(text, content, calls):
    got_content, got_calls = _run([text])
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_every_split_gives_the_same_result(text):
    whole = _run([text])
    assert parse_all(text).content == whole[0] and parse_all(text).calls == whole[1]
    for i in range(len(text) + 1):  # every single split point
        assert _run([text[:i], text[i:]]) == whole, f"split at {i}"
    assert _run(list(text)) == whole  # one character at a time
    rng = random.Random(0)
    for _ in range(50):  # several split points at once
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert _run(pieces) == whole, pieces


def test_content_streams_before_the_call_ends():
    parser = ToolCallParser()
    assert parser.feed("Sure, checking").content == "Sure, checking"
    assert parser.feed(" now <tool_c").content == " now"  # a possible tag start is held back
    out = parser.feed('all>{"name": "f", "arguments": {}}')
    assert out.content == "" and out.calls == []  # the call is not complete yet
    out = parser.feed("</tool_call>")
    assert [c.name for c in out.calls] == ["f"]


def test_prefilled_call_is_continued():
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    out = parse_all('{"city": "Oslo"}}\n', prefix=prefix)
    assert out.content == "" and [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    # the model wrote something that is not JSON: it stays visible as content, nothing is invented
    bad = parse_all("I don't know", prefix=prefix)
    assert bad.calls == [] and bad.content == prefix + "I don't know"


def test_bare_json_can_be_disabled():
    parser = ToolCallParser(allow_bare_json=False)
    out = parser.feed(W)
    out += parser.finish()
    assert out.calls == [] and out.content == W
