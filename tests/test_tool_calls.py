"""Tool calls: the hermes tool-call parser (unit), and SmolLM2 behind `engine serve --tool-call-parser hermes`
driven by the official openai client (parse() with a pydantic model, required and auto tool choices)."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.tool_parsers.hermes import HermesToolParser
from tests.helpers import Server

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TEXT = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")


def stream_through(parser: HermesToolParser, text: str, seed: int) -> tuple[str, list[dict]]:
    """Feed ``text`` in random pieces; the content and the calls that come out."""
    rng = random.Random(seed)
    content, calls, position = "", [], 0
    while position < len(text):
        end = min(len(text), position + rng.randint(1, 7))
        delta = parser.extract_tool_calls_streaming(text[:position], text[:end], text[position:end], end == len(text))
        position = end
        if delta is not None:
            content += delta.content or ""
            calls += delta.tool_calls
    return content, calls


def test_hermes_extracts_calls_and_content():
    extracted = HermesToolParser(None).extract_tool_calls(TEXT)
    assert extracted.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Oslo", "days": 3}),
    ]
    assert HermesToolParser(None).extract_tool_calls("no calls here").tool_calls == []
    broken = "<tool_call>{not json}</tool_call>"
    assert HermesToolParser(None).extract_tool_calls(broken).content == broken  # never a silent loss
    unclosed = HermesToolParser(None).extract_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert [c.name for c in unclosed.tool_calls] == ["f"]


@pytest.mark.parametrize("seed", range(8))
def test_hermes_streaming_gives_the_same_as_the_whole_text(seed):
    content, calls = stream_through(HermesToolParser(None), TEXT, seed)
    assert content.strip() == "Let me check."
    assert [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Oslo"]
    plain, none = stream_through(HermesToolParser(None), "a < b and <tool is not a tag", seed)
    assert plain == "a < b and <tool is not a tag" and none == []


# ---- SmolLM2 behind the server ------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=20)


@pytest.fixture(scope="module")
def smol_client(smollm2_gguf):
    server = Server(
        "--model",
        smollm2_gguf,
        "--served-model-name",
        "smol",
        "--kv-cache-memory",
        "96MiB",
        "--max-model-len",
        "1024",
        "--tool-call-parser",
        "hermes",
    )
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()


@pytest.mark.slow
def test_openai_parse_returns_a_pydantic_object(smol_client):
    for seed in range(3):
        completion = smol_client.chat.completions.parse(
            model="smol",
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format=Person,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        person = completion.choices[0].message.parsed
        assert isinstance(person, Person) and 0 <= person.age <= 120


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_a_given_tool(smol_client, stream):
    kwargs = dict(
        model="smol",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=1.0,
        max_tokens=200,
        seed=1,
        parallel_tool_calls=False,
    )  # one call: a small model may otherwise list calls to max_tokens
    if stream:
        calls, finish = {}, None
        for chunk in smol_client.chat.completions.create(**kwargs, stream=True):
            finish = chunk.choices[0].finish_reason or finish
            for delta in chunk.choices[0].delta.tool_calls or []:
                calls[delta.index] = (delta.function.name, delta.function.arguments)
        calls = list(calls.values())
    else:
        choice = smol_client.chat.completions.create(**kwargs).choices[0]
        finish = choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls_from_the_text(smol_client, stream):
    # the model is made to answer in the hermes format (a regex), as a tool-trained model would by itself
    forced = (
        r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
        r'"days": [1-7]\}\}</tool_call>'
    )
    kwargs = dict(
        model="smol",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        temperature=1.0,
        max_tokens=120,
        extra_body={"structured_outputs": {"regex": forced}},
    )
    if stream:
        content, calls, finish = "", [], None
        for chunk in smol_client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        calls = [(c.function.name, c.function.arguments) for c in calls]
    else:
        choice = smol_client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS["get_weather"])
    plain = smol_client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi!"}], tools=[WEATHER], max_tokens=8, temperature=0.0
    ).choices[0]
    assert plain.message.tool_calls is None and plain.message.content  # no call written: a plain answer
