"""langchain-openai's ChatOpenAI over `petrel serve`: invoke and stream (the same greedy text the openai SDK gets),
bind_tools with a forced call and the tool result sent back, with_structured_output by JSON schema and by function
calling."""

from __future__ import annotations

import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

QUESTION = "What is a petrel?"


class Bird(BaseModel):
    name: str = Field(max_length=24)
    wingspan_cm: int = Field(ge=0, le=999)


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"{city}: sunny, 21 C"


@pytest.fixture(scope="module")
def model_id(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id


@pytest.fixture(scope="module")
def chat_model(base_url, model_id):
    return ChatOpenAI(base_url=base_url, api_key="unused", model=model_id, temperature=0, max_tokens=24, max_retries=0)


def test_invoke_and_stream(chat_model, base_url, model_id):
    sdk = openai.OpenAI(base_url=base_url, api_key="unused").chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24
    )
    answer = chat_model.invoke(QUESTION)
    assert answer.content == sdk.choices[0].message.content
    chunks = list(chat_model.stream(QUESTION))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == answer.content


def test_bind_tools_round_trip(chat_model):
    bound = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = chat_model.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert answer.content and not answer.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat_model, method):
    longer = chat_model.model_copy(update={"max_tokens": 64})
    out = longer.with_structured_output(Bird, method=method, include_raw=True).invoke("Describe a seabird.")
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], Bird)
