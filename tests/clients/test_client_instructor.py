"""instructor over `petrel serve`: a pydantic model out of the default model, in TOOLS mode (a forced function call)
and JSON_SCHEMA mode (response_format json_schema); both are held to the schema, so the result validates."""

from __future__ import annotations

import instructor
import openai
import pytest
from pydantic import BaseModel


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_modes(base_url, mode):
    raw = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    client = instructor.from_openai(raw, mode=mode)
    person, completion = client.chat.completions.create_with_completion(
        model=raw.models.list().data[0].id,
        response_model=Person,
        messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
        temperature=0,
        max_tokens=48,
        max_retries=0,
    )
    assert isinstance(person, Person)
    message = completion.choices[0].message
    if mode == instructor.Mode.TOOLS:
        (call,) = message.tool_calls
        assert (
            call.function.name == "Person"
            and Person.model_validate_json(call.function.arguments).model_dump() == person.model_dump()
        )
    else:
        assert Person.model_validate_json(message.content).model_dump() == person.model_dump()
