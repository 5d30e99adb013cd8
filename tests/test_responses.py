"""The Responses API (`POST /v1/responses`) driven by the official openai client: plain and streamed answers, the
typed event sequence, function tools, reasoning items, structured text, the store and ``previous_response_id``."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest

from engine.entrypoints.openai.responses_store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(features_server):
    return openai.OpenAI(base_url=features_server.url + "/v1", api_key="unused", max_retries=0)


def test_create_retrieve_and_delete(client):
    response = client.responses.create(
        model="tiny", input="Say something", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and response.output[0].content[0].type == "output_text"
    assert response.usage.output_tokens == 8 and response.usage.total_tokens == response.usage.input_tokens + 8
    assert response.instructions == "Be brief." and response.store is True
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_streaming_events_accumulate_to_the_same_answer(client):
    kwargs = dict(model="tiny", input=[{"role": "user", "content": "Tell me"}], max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert types[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # streamed responses are stored too


def test_named_function_tool_and_previous_response_id(client):
    first = client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    with client.responses.stream(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments == streamed.output[0].arguments
    assert "response.function_call_arguments.done" in [e.type for e in events]
    # the conversation goes on server-side: the tool's output answers the call
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'}],
        max_output_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn and the tool's output
    alone = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
    )
    assert alone.usage.input_tokens == second.usage.input_tokens and alone.output_text == second.output_text


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
    response = client.responses.create(
        model="tiny",
        input="A name please",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_reasoning_items(client):
    regex = {"regex": "<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}"}
    kwargs = dict(
        model="tiny", input="think", max_output_tokens=80, temperature=0, extra_body={"structured_outputs": regex}
    )
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0].content[0].text
    assert reasoning and "<think>" not in reasoning and "think>" not in response.output_text
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": []}, "input"),
        ({"input": "hi", "tool_choice": "auto"}, "tool_choice"),
        ({"input": "hi", "temperature": -1}, "temperature"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)
def test_bad_input_answers_400_naming_the_field(features_server, body, param):
    response = httpx.post(features_server.url + "/v1/responses", json={"model": "tiny", **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_store_is_bounded_by_size_and_age():
    clock = [0.0]
    store = ResponseStore(2, 10.0, clock=lambda: clock[0])
    for name in "abc":
        store.put({"id": name}, [])
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2  # the oldest went first
    clock[0] = 10.5
    assert store.get("b") is None and len(store) == 0  # expired


def test_auto_tool_calls_are_read_from_the_answer_after_the_reasoning(client):
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", "days": [1-9]\}\}\n</tool_call>'
    regex = {"regex": "<think>[a-z]{2,8}( [a-z]{2,8}){0,3}</think>\n" + call}
    kwargs = dict(
        model="tiny",
        input="Weather?",
        tools=[WEATHER],
        max_output_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": regex},
    )
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[1].name == "get_weather" and json.loads(response.output[1].arguments)["days"] >= 1
    with client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == ["reasoning", "function_call"]
    assert streamed.output[1].arguments == response.output[1].arguments


def test_priorities_are_served_and_disconnects_leave_no_kv_in_use(features_server):
    from tests.test_server import metric

    url = features_server.url

    async def responses_stream(index: int, disconnect: bool) -> int:
        body = {
            "model": "tiny",
            "input": f"request {index}",
            "max_output_tokens": 30,
            "stream": True,
            "priority": index % 3,
        }
        events = 0
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", url + "/v1/responses", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        events += 1
                        if disconnect and events == 6:
                            return -1
        return events

    async def beam_search_cut_short() -> None:
        body = {"prompt": "beams", "max_tokens": 480, "n": 4, "use_beam_search": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=1.0) as http:
            with pytest.raises(httpx.TimeoutException):
                await http.post(url + "/v1/completions", json=body)

    async def run():
        return await asyncio.gather(
            *(responses_stream(i, False) for i in range(6)),
            *(responses_stream(i, True) for i in range(6)),
            beam_search_cut_short(),
        )

    results = asyncio.run(run())
    assert all(r > 6 for r in results[:6]) and all(r == -1 for r in results[6:12])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        metric(features_server, "engine_kv_cache_usage_perc") > 0
        or metric(features_server, "engine_num_requests_running") > 0
    ):
        time.sleep(0.2)
    assert metric(features_server, "engine_kv_cache_usage_perc") == 0.0
    assert metric(features_server, "engine_num_requests_running") == 0.0
    received = metric(features_server, "engine_num_requests_received")
    time.sleep(1.5)  # the beam search cut short takes no further step: no beam request reaches the engine any more
    assert metric(features_server, "engine_num_requests_received") == received
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3},
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
