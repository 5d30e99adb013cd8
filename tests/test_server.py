"""`engine serve` end to end: a subprocess on a loopback port, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.helpers import Server

MODEL_NAME = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = Server(
        "--model",
        tiny_llama,
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "128",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_version_answers_the_installed_engine_version(monkeypatch):
    """/version reads the package's version, which comes from the installed distribution's metadata."""
    import asyncio
    import importlib.metadata

    import engine
    from engine.entrypoints.openai.routers import health

    assert engine.__version__ == importlib.metadata.version("engine")
    monkeypatch.setattr(engine, "__version__", "9.9.9+test")
    assert asyncio.run(health.version()) == {"version": "9.9.9+test"}


def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    import importlib.metadata

    # the installed distribution's version, as vLLM's /version answers (not a constant of the handler)
    assert httpx.get(server.url + "/version").json() == {"version": importlib.metadata.version("engine")}
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_and_usage(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=7, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == out.usage.prompt_tokens + 7
    batch = client.completions.create(
        model=MODEL_NAME, prompt=["Hello there", "Good morning"], max_tokens=3, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == out.choices[0].text[
        : len(batch.choices[0].text)
    ]


def test_chat_completion(client, server):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, temperature=0
    )
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 5
    tokens = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tokens["count"] == out.usage.prompt_tokens
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "<|im_start|>user" in text


def test_streaming_with_usage_equals_non_streaming(client):
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "tell me"}], max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "tell me"}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    stream = list(client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=6, temperature=0, stream=True))
    assert all(c.usage is None for c in stream)


def test_stop_n_logprobs_seed(client):
    base = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"

    two = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=6, n=2, temperature=1.0, seed=4)
    assert sorted(c.index for c in two.choices) == [0, 1] and two.usage.completion_tokens == 12
    again = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=6, n=2, temperature=1.0, seed=4)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]

    logprobs = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = logprobs.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy takes the most likely
    comp = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=3, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.token_logprobs) == 3 and len(comp.choices[0].logprobs.top_logprobs[0]) == 2


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 5}, 400, "top_p"),
        ({"prompt": "hi", "model": "nope"}, 404, "model"),
        ({"prompt": [5] * 600}, 400, None),
        ({"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "logit_bias"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "hi", "priority": 3}, 400, "priority"),  # the server's policy is fcfs
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(server, client, body, status, param):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = httpx.post(server.url + "/v1/completions", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param:
        assert error["param"] == param
    assert client.completions.create(model=MODEL_NAME, prompt="still up?", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "max_token": 3}, "max_token"),  # misspelt: never fails open
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
            "functions",
        ),  # OpenAI's legacy field: use tools
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"usage": 1}},
            "stream_options.usage",
        ),
    ],
)
def test_unknown_fields_answer_400_naming_them(server, path, body, param):
    response = httpx.post(server.url + path, json={"max_tokens": 2, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and f"unknown field '{param}'" in error["message"]


def test_openai_fields_without_effect_are_accepted(client, server):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=False,
    )
    assert out.usage.completion_tokens == 2
    out = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, user="u1")
    assert out.usage.completion_tokens == 2


def test_chat_roles_are_checked(server):
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["param"] == "messages.0.role" and "'wizard'" in error["message"]
    for role in ("system", "developer"):
        ok = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "messages": [{"role": role, "content": "be brief"}, {"role": "user", "content": "x"}],
                "max_tokens": 1,
            },
        )
        assert ok.status_code == 200, ok.text


def test_chat_errors(server):
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    bad = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


def test_concurrent_streams_and_disconnects_leave_no_kv_in_use(server):
    async def stream(index: int, disconnect: bool) -> int:
        body = {
            "model": MODEL_NAME,
            "prompt": f"request {index} says",
            "max_tokens": 40 if disconnect else 16,
            "temperature": 0.7,
            "stream": True,
            "ignore_eos": True,
        }
        chunks = 0
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", server.url + "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks += 1
                        if disconnect and chunks == 3:
                            return -1  # leave mid-stream: the context manager closes the connection
                    if line == "data: [DONE]":
                        return chunks
        return chunks

    async def run():
        return await asyncio.gather(*(stream(i, False) for i in range(64)), *(stream(i, True) for i in range(16)))

    results = asyncio.run(run())
    assert all(r >= 16 for r in results[:64]) and all(r == -1 for r in results[64:])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (
        metric(server, "engine_kv_cache_usage_perc") > 0 or metric(server, "engine_num_requests_running") > 0
    ):
        time.sleep(0.2)
    assert metric(server, "engine_kv_cache_usage_perc") == 0.0
    assert metric(server, "engine_num_requests_running") == 0.0
    assert metric(server, "engine_generation_tokens_total") >= 64 * 16
    assert metric(server, "engine_time_to_first_token_seconds_count") >= 64


def test_yaml_config_and_flag_override(tiny_llama, tmp_path):
    config = tmp_path / "deploy.yaml"
    config.write_text(
        f"model:\n  model: {tiny_llama}\n  served_model_name: from-yaml\n  dtype: float32\n"
        "cache:\n  kv_cache_memory: 32MiB\n  block_size: 32\nattention:\n  backend: torch\n"
        "scheduler:\n  max_num_batched_tokens: 256\n"
    )
    # the suite's KV-cache variable (conftest) would beat the file
    srv = Server(
        "--config",
        str(config),
        "--max-num-batched-tokens",
        "128",
        "--api-key",
        "sekret",
        env={"ENGINE_CACHE__KV_CACHE_MEMORY": None},
    )
    try:
        log = srv.output()
        assert "'max_num_batched_tokens': 128" in log  # the flag beats the file
        assert "'block_size': 32" in log and "torch" in log and "(as configured)" in log
        assert "blocks of 32 tokens" in log and "32.0 MiB" in log
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        keyed = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert [m.id for m in keyed.models.list().data] == ["from-yaml"]
        assert keyed.completions.create(model="from-yaml", prompt="x", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(srv.url + "/health").status_code == 200  # not under /v1: no key needed
    finally:
        srv.stop()


def test_engine_that_cannot_start_exits_non_zero_with_one_clear_line(tiny_llama):
    srv = Server("--model", tiny_llama, "--attention", "nope", wait_healthy=False)
    try:
        assert srv.proc.wait(120) == 1
        failures = [line for line in srv.output().splitlines() if "engine failed to start" in line]
        assert len(failures) == 1 and "attention.backend" in failures[0], srv.output()
    finally:
        srv.stop()


# ---- structured outputs and tool calls (the tiny model: outputs are random, constraints still hold) ----------
DIGIT_SCHEMA = {
    "type": "object",
    "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}, "unit": {"enum": ["cm", "in"]}},
    "required": ["digit", "unit"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}


def test_response_format_json_schema_and_structured_outputs(client):
    import jsonschema

    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "measure"}],
        max_tokens=64,
        temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "m", "schema": DIGIT_SCHEMA}},
    )
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), DIGIT_SCHEMA)
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="pick",
        max_tokens=16,
        temperature=1.0,
        n=4,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert {c.text for c in completion.choices} <= {"left", "right"}


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                    },
                }
            },
            "structured_outputs",
            "xgrammar",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "xgrammar"),
        ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs", "uniqueItems"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"tools": [WEATHER_TOOL]}, "tool_choice", "--tool-call-parser"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"structured_outputs": {"json": json.loads('{"type": "array", "items": ' * 300 + "{}" + "}" * 300)}},
            "structured_outputs.json",
            "deeper than 128",
        ),
        (
            {"structured_outputs": {"json": '{"items": ' * 5000 + "{}" + "}" * 5000}},
            "structured_outputs.json",
            "deeper than 128",
        ),
    ],
)
def test_bad_constraints_and_tool_choices_answer_400(server, body, param, words):
    response = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_named_tool_choice_returns_valid_tool_calls_streamed_and_not(client):
    import jsonschema

    schema = WEATHER_TOOL["function"]["parameters"]
    kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "weather?"}],
        max_tokens=64,
        temperature=1.0,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    arguments, names, ids, finish = "", set(), set(), None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            names.add(delta.function.name) if delta.function.name else None
            ids.add(delta.id) if delta.id else None
            arguments += delta.function.arguments or ""
    assert names == {"get_weather"} and len(ids) == 1 and finish == "stop"
    jsonschema.validate(json.loads(arguments), schema)


def test_no_shadow_answers_404_with_an_openai_error(server):
    response = httpx.get(server.url + "/v1/shadow")
    assert response.status_code == 404 and "--shadow" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/score", {"text_1": "hi", "text_2": ["a", "b"]}),
        ("/rerank", {"query": "hi", "documents": ["a", "b"]}),
        ("/pooling", {"input": "hi"}),
        ("/classify", {"input": "hi"}),
    ],
)
def test_pooling_endpoints_answer_400_on_a_generative_model(server, client, path, body):
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and "generative model" in error["message"]
    assert client.completions.create(model=MODEL_NAME, prompt="still up?", max_tokens=2).usage.completion_tokens == 2
