"""The openai SDK against `petrel serve`: models.retrieve and chat.completions.parse (structured output into a
pydantic model)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from petrel.serve.app import DEFAULT_MODEL_NAME


class City(BaseModel):
    name: str
    population: int


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_retrieve(client):
    (listed,) = client.models.list().data
    card = client.models.retrieve(listed.id)
    assert (card.id, card.object, card.created) == (listed.id, "model", listed.created)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-" + DEFAULT_MODEL_NAME)


def test_chat_completions_parse(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Name a large city and its population."}],
        response_format=City,
        temperature=0,
        max_completion_tokens=48,
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City) and message.parsed == City(**json.loads(message.content))
