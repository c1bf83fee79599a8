"""openai-agents over the Chat Completions model: an agent with one function tool, the call forced and its result
the agent's final output (tool_use_behavior="stop_on_first_tool"); ModelSettings' store and metadata are sent."""

from __future__ import annotations

import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI, OpenAI

calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"weather in {city}: sunny"


@pytest.fixture(autouse=True)
def no_tracing():
    set_tracing_disabled(True)  # the trace exporter would post to api.openai.com
    yield
    set_tracing_disabled(False)


def test_agent_with_a_function_tool_over_chat_completions(base_url):
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather with the tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(
            model=OpenAI(base_url=base_url, api_key="unused").models.list().data[0].id, openai_client=client
        ),
        model_settings=ModelSettings(
            store=False, metadata={"test": "agents"}, tool_choice="get_weather", temperature=0, max_tokens=48
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    calls.clear()
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert result.final_output == f"weather in {calls[0]}: sunny"
