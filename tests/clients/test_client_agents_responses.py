"""openai-agents over petrel's Responses API (OpenAIResponsesModel): an agent with one function tool, forced to
call it and stopping on its result, streamed and not, with the ModelSettings openai-agents sends (store,
metadata)."""

from __future__ import annotations

import asyncio
import json

import pytest

agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e .[test])")
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def _agent(base_url: str, calls: list) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = OpenAIResponsesModel(MODEL, AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0))
    return Agent(
        name="weather",
        instructions="Answer questions about the weather with the get_weather tool.",
        model=model,
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(
            tool_choice="required", temperature=0, max_tokens=40, store=False, metadata={"test": "agents"}
        ),
    )


async def _run(base_url: str, streamed: bool):
    calls: list = []
    agent = _agent(base_url, calls)
    config = RunConfig(tracing_disabled=True)
    question = "What is the weather in Paris?"
    if streamed:
        result = Runner.run_streamed(agent, question, run_config=config)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, question, run_config=config)
    return result, calls


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_agent_function_tool_over_responses(base_url, streamed):
    result, calls = asyncio.run(_run(base_url, streamed))
    assert len(calls) == 1 and isinstance(calls[0], str) and calls[0]
    assert result.final_output == f"sunny in {calls[0]}"  # stop_on_first_tool: the tool's result is the output
    (response,) = result.raw_responses
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": calls[0]}
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
