"""Reasoning output: <think>...</think> split out as reasoning_content (petrel/serve/reasoning.py), in the parser on
every split of an output, and through the server with a Qwen3-style template on the default model (the output held
to a known text by guided_regex, so the assertions are about the split, not the model)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from petrel.serve.app import build_app
from petrel.serve.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning, uses_think_tags

# Qwen3's convention: enable_thinking=false closes an empty think block in the prompt
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
USER = [{"role": "user", "content": "Say hello."}]
THOUGHT = "<think>\nThe user greets me.\n</think>\n\nHello!"


@pytest.mark.parametrize(
    "text, in_reasoning, want",
    [
        (THOUGHT, False, ("\nThe user greets me.\n", "Hello!")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("Hello <think>x</think>", False, (None, "Hello <think>x</think>")),  # not at the start: content
        ("<thin", False, (None, "<thin")),
        ("<think>cut short by max_tokens", False, ("cut short by max_tokens", "")),
        ("plan</think>\n\nAnswer", True, ("plan", "Answer")),  # the prompt opened the block (DeepSeek-R1)
        ("", False, (None, "")),
    ],
)
def test_every_split_gives_the_same_reasoning_and_content(text, in_reasoning, want):
    assert split_reasoning(text, in_reasoning) == want
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            parser = ReasoningParser(in_reasoning)
            got = [parser.feed(p) for p in pieces] + [parser.finish()]
            assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (want[0] or "", want[1])


def test_which_templates_and_prompts_think():
    assert uses_think_tags(THINK_TEMPLATE) and not uses_think_tags("{{ messages }}") and not uses_think_tags(None)
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def thinking(llm):
    with TestClient(build_app(llm, "thinker", chat_template=THINK_TEMPLATE)) as client:
        yield client


def _chat(client, regex: str, stream: bool = False, **body):
    body = {"messages": USER, "temperature": 0, "max_completion_tokens": 32, "guided_regex": regex, **body}
    r = client.post("/v1/chat/completions", json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_reasoning_content_separate_from_content(thinking):
    regex = THOUGHT.replace(".", r"\.")
    message = _chat(thinking, regex)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("\nThe user greets me.\n", "Hello!")
    deltas = [c["delta"] for event in _chat(thinking, regex, stream=True) for c in event["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "Hello!"
    assert all("<think>" not in d.get("content", "") for d in deltas)


def test_enable_thinking_false_reaches_the_template(thinking):
    off = _chat(thinking, "Hello!", chat_template_kwargs={"enable_thinking": False}, return_token_ids=True)
    on = _chat(thinking, "Hello!", return_token_ids=True)
    assert off["prompt_token_ids"][len(on["prompt_token_ids"]) :]  # the closed think block the template added
    assert "reasoning_content" not in off["choices"][0]["message"]
    assert off["choices"][0]["message"]["content"] == "Hello!"


def test_off_for_a_template_without_think_tags(llm):
    with TestClient(build_app(llm, "plain")) as client:
        message = _chat(client, r"<think>x</think>Hi")["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "<think>x</think>Hi"
