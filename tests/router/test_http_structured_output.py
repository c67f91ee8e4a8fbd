"""JSON mode and structured outputs end to end: the ``openai`` client -> HTTP -> coordinator (schema
compiled and checked) -> wire -> the agent that samples (llguidance mask over SmolLM2's vocabulary)
on the real test cluster. The answers parse as JSON and match the schema, streamed or not, also
when the sampling agent dies mid-answer; a bad schema or an unknown type is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

MODEL = "smollm2-135m"
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Give me a person with a name, an age and the languages they speak, as JSON."}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_json_mode_answers_one_json_object(serving_cluster) -> None:
    client = serving_cluster.client()
    ask = [{"role": "user", "content": "Name a fruit and its colour, in JSON."}]
    free = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    choice = out.choices[0]
    value = json.loads(choice.message.content)
    assert isinstance(value, dict) and value and choice.finish_reason == "stop"
    assert not free.choices[0].message.content.startswith("{")  # left free, the model writes prose


def test_structured_output_matches_the_schema_streamed_or_not(serving_cluster) -> None:
    client = serving_cluster.client()
    out = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=80, temperature=0,
                                         response_format=PERSON_FORMAT)
    content = out.choices[0].message.content
    jsonschema.validate(json.loads(content), PERSON)
    assert out.choices[0].finish_reason == "stop"
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=80, temperature=0,
                                                response_format=PERSON_FORMAT, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert "".join(parts) == content and finish == "stop"
    # sampled too: whatever the draws, JSON that matches (the schema bounds its length)
    for seed in (1, 2):
        sampled = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=160, temperature=0.9,
                                                 seed=seed, response_format=PERSON_FORMAT)
        assert sampled.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(sampled.choices[0].message.content), PERSON)
    # max_tokens cuts a document short, with finish_reason "length"
    short = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=4, temperature=0,
                                           response_format=PERSON_FORMAT)
    assert short.choices[0].finish_reason == "length" and content.startswith(short.choices[0].message.content)


def test_bad_response_formats_are_400s_naming_the_field(serving_cluster) -> None:
    client = serving_cluster.client()
    cases = [
        ({"type": "yaml"}, "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}},
         "response_format.json_schema.schema: the JSON schema cannot be enforced: Invalid type: objekt"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "(["}}},
         "response_format.json_schema.schema: the JSON schema cannot be enforced: regex parse error"),
    ]
    for response_format, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=8,
                                           response_format=response_format)  # type: ignore[arg-type]
        assert info.value.status_code == 400 and info.value.body["param"] == "response_format"
        assert words in info.value.body["message"], info.value.body
    # and the server keeps serving structured output
    ok = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=80, temperature=0,
                                        response_format=PERSON_FORMAT)
    jsonschema.validate(json.loads(ok.choices[0].message.content), PERSON)


def test_a_failover_continues_the_same_constrained_answer(serving_cluster) -> None:
    """The sampling stage dies mid-JSON: the new pipeline's last stage replays the tokens generated so
    far through its grammar matcher, so the answer is the uninterrupted one (a matcher that started
    over would force a second opening brace)."""
    client = serving_cluster.client()
    ask = dict(model=MODEL, messages=ASK_PERSON, max_tokens=80, temperature=0, response_format=PERSON_FORMAT)
    expected = client.chat.completions.create(**ask).choices[0].message.content
    parts: list[str] = []
    victim, info = None, None
    for chunk in client.chat.completions.create(**ask, stream=True):
        info = (chunk.model_extra or {}).get("helix") or info
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if len(parts) == 5 and victim is None:
                victim = info["pipelines"][0][-1]["node"]  # the stage that samples
                serving_cluster.agents.kill(victim)
    assert victim is not None, "the answer was too short to kill an agent mid-generation"
    assert info is not None and info["reroutes"] >= 1
    assert "".join(parts) == expected
    jsonschema.validate(json.loads(expected), PERSON)
    serving_cluster.agents.start_one(victim)
    serving_cluster.agents.wait_ready(timeout_s=240)
    serving_cluster.wait_until(lambda: serving_cluster.health()["nodes"][victim], what=f"{victim} back")
