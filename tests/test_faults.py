"""Faults and hostile input: one request never takes the engine down, nothing accepted is lost or leaked,
and every process the engine starts ends with it. Run alone: ``python -m pytest -m faults``.

Each case asserts what a client sees (an OpenAI-style error, never a hang or a plain-text 500), what
/health says, that the KV cache and the queues drain back to zero, and that no process outlives the
server.
"""

from __future__ import annotations

import asyncio
import glob
import importlib
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import psutil
import pytest

from engine import LLM, SamplingParams
from engine.messages import ENCODER, EngineCoreRequest, EngineCoreRequestType, engine_identity
from engine.testing import inspect
from tests.helpers import (
    Server,
    alive,
    assert_all_blocks_free,
    command_line,
    install_fixture_plugins,
    random_prompts,
    wait_for_async,
    wait_until,
)

pytestmark = pytest.mark.faults
FAULTY_PLUGIN = Path(__file__).parent / "plugin_fixtures" / "engine_faulty_plugin"
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


# ---- helpers ---------------------------------------------------------------------------------------


def engine_core_of(srv: Server) -> psutil.Process:
    """The engine-core process: the server's child that is not multiprocessing's resource tracker."""
    for _ in range(100):
        for child in psutil.Process(srv.proc.pid).children():
            command = command_line(child)
            if command and "resource_tracker" not in command:
                return child
        time.sleep(0.1)
    raise AssertionError("no engine-core process")


def metrics(srv: Server) -> dict[str, float]:
    values = {}
    for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{", 1)[0]] = float(value)
    return values


def assert_drained(srv: Server, timeout: float = 20) -> None:
    """No request running or waiting, and no KV block in use (every block came back)."""

    def idle() -> bool:
        m = metrics(srv)
        return (
            m["engine_num_requests_running"] == 0
            and m["engine_num_requests_waiting"] == 0
            and m["engine_kv_cache_usage_perc"] == 0
        )

    assert wait_until(idle, timeout, 0.3), metrics(srv)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def completion(srv: Server, headers: dict | None = None, **body) -> httpx.Response:
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(srv.url + "/v1/completions", json=body, headers=headers or {}, timeout=120)


def assert_serving(srv: Server, headers: dict | None = None) -> None:
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    response = completion(srv, headers)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


async def read_stream(
    url: str,
    body: dict,
    headers: dict | None = None,
    stop_after: int | None = None,
    timeout: float = 120,
    events: list | None = None,
) -> dict:
    """Stream a completion: its data events, whether it ended with [DONE], and any error event. ``events``, when
    given, is filled as the events arrive (a caller can wait for a stream to be under way)."""
    events, error = ([] if events is None else events), None
    async with httpx.AsyncClient(timeout=timeout) as http:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", url + "/v1/completions", json=body, headers=headers or {}) as response:
            if response.status_code != 200:
                return {
                    "status": response.status_code,
                    "events": [],
                    "done": False,
                    "error": json.loads(await response.aread())["error"],
                }
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return {"status": 200, "events": events, "done": True, "error": error}
                if line.startswith("data: "):
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        error = payload["error"]
                    else:
                        events.append(payload)
                    if stop_after is not None and len(events) >= stop_after:
                        return {"status": 200, "events": events, "done": False, "error": None}
    return {"status": 200, "events": events, "done": False, "error": error}


def stream_tokens(result: dict) -> int:
    """Completion tokens of a stream that finished, from its usage chunk."""
    usage = [e["usage"] for e in result["events"] if not e["choices"] and e.get("usage")]
    return usage[-1]["completion_tokens"] if usage else -1


def ipc_dirs(tmp: Path) -> list[str]:
    return glob.glob(str(tmp / "engine-ipc-*"))


@pytest.fixture(scope="session")
def faulty_plugin_env(tmp_path_factory) -> dict:
    """The engine-faulty-plugin fixture distribution installed into a private folder on PYTHONPATH."""
    return install_fixture_plugins(tmp_path_factory, "engine_faulty_plugin")


@pytest.fixture
def faulty_processor_in_process():
    """The same faulty logits processor registered in this process's plugin manager (in-process engines)."""
    from engine.plugins import get_plugin_manager

    sys.path.insert(0, str(FAULTY_PLUGIN))
    module = importlib.import_module("engine_faulty_plugin.plugin")
    manager = get_plugin_manager()
    manager._register(module, "faulty-test", "engine-faulty-plugin (tests)")
    yield
    manager.pm.unregister(module)
    sys.path.remove(str(FAULTY_PLUGIN))


# ---- the engine core: a failing request fails alone ------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_that_raises_in_the_core_fails_alone(tiny_llama, faulty_processor_in_process, async_scheduling):
    llm = LLM(tiny_llama, dtype="float32", async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, (5, 40), seed=7)]
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, extra_args={"fail": index == 2})
        for index in range(5)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    failed = outputs[2]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "faulty processor" in failed.error
    reference = llm.generate(
        [p for i, p in enumerate(prompts) if i != 2],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    kept = [o for i, o in enumerate(outputs) if i != 2]
    assert [o.outputs[0].token_ids for o in kept] == [o.outputs[0].token_ids for o in reference]
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in kept)
    assert_all_blocks_free(llm)
    alone = llm.generate([prompts[0]], [SamplingParams(max_tokens=3, extra_args={"fail": True})], use_tqdm=False)
    assert alone[0].outputs[0].finish_reason == "error"
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_the_core_refuses_what_the_front_end_should_have(tiny_llama):
    """Any client may talk to the core: bad token ids or a reused request id fail that request only."""
    llm = LLM(tiny_llama, dtype="float32")
    core = inspect(llm).engine_core
    bad_bias = SamplingParams(max_tokens=2)
    bad_bias.logit_bias = {-100000: 5.0}  # past the constructor's checks, as a raw client could send it
    core.add_request(EngineCoreRequest("neg-prompt", [1, -5, 3], SamplingParams(max_tokens=2), 2, 0.0))
    core.add_request(EngineCoreRequest("neg-bias", [1, 2, 3], bad_bias, 2, 0.0))
    core.add_request(EngineCoreRequest("ok", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), 2, 0.0))
    core.add_request(EngineCoreRequest("ok", [1, 2, 3], SamplingParams(max_tokens=2), 2, 0.0))
    finished = {}
    while core.has_work():
        for out in core.step().outputs:
            if out.finish_reason:
                finished.setdefault(out.request_id, []).append((out.finish_reason, out.error))
    assert finished["neg-prompt"][0][0] == "error" and "prompt token ids" in finished["neg-prompt"][0][1]
    assert finished["neg-bias"][0][0] == "error" and "logit_bias" in finished["neg-bias"][0][1]
    assert [reason for reason, _ in finished["ok"]] == ["error", "length"]  # the duplicate id, then the original
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_the_core_process_survives_malformed_messages(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", engine_core_process=True)
    client = inspect(llm).client
    bad_params = msgspec.msgpack.encode(
        {
            "request_id": "raw",
            "prompt_token_ids": [1, 2],
            "eos_token_id": 2,
            "arrival_time": 0.0,
            "sampling_params": {"logit_bias": {"-1": 5}},
        }
    )
    for frames in (
        [EngineCoreRequestType.ADD.value, b"\xc1garbage"],
        [b"\x09", b""],
        [EngineCoreRequestType.ADD.value, bad_params],
        [EngineCoreRequestType.ABORT.value, ENCODER.encode({"not": "a list"})],
    ):
        client.input_socket.send_multipart([engine_identity(0), *frames])
    out = llm.generate(["still alive?"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and client.proc.is_alive()
    assert_all_blocks_free(llm)
    llm.shutdown()


# ---- the HTTP layer without an engine ----------------------------------------------------------------
def test_an_unhandled_exception_is_a_json_500_with_the_request_id():
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from engine.entrypoints.openai.middleware import RequestGuardMiddleware

    async def boom(request):
        raise OverflowError("int too big to convert")

    async def echo(request):
        from starlette.responses import JSONResponse

        return JSONResponse({"bytes": len(await request.body())})

    app = Starlette(
        routes=[Route("/boom", boom, methods=["POST"]), Route("/echo", echo, methods=["POST"])],
        middleware=[Middleware(RequestGuardMiddleware, max_body_bytes=2048)],
    )  # as build_app adds it
    with TestClient(app, raise_server_exceptions=False) as http:
        response = http.post("/boom", headers={"X-Request-Id": "req-42"})
        error = assert_openai_error(response, 500)
        assert error["type"] == "InternalServerError" and "req-42" in error["message"]
        assert response.headers["x-request-id"] == "req-42"
        assert http.post("/echo", content=b"x" * 100).json() == {"bytes": 100}
        assert_openai_error(http.post("/echo", content=b"x" * 4096), 413)
        chunked = http.post("/echo", content=iter([b"x" * 1024] * 4))  # no content-length: counted as it comes
        assert_openai_error(chunked, 413)


# ---- a server under hostile input (API key on) ---------------------------------------------------------
@pytest.fixture(scope="module")
def hostile_server(tiny_llama, faulty_plugin_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile-tmp")
    srv = Server(
        "--model",
        tiny_llama,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "1024",
        "--api-key",
        KEY,
        env={**faulty_plugin_env, "TMPDIR": str(tmp)},
    )
    srv.tmp = tmp
    yield srv
    srv.stop()


HOSTILE_BODIES = [
    ({"logit_bias": {"-100000": 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ('{"prompt": "hi", "logit_bias": {"5": Infinity}}', None),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ('{"prompt": "hi", "logit_bias": {"5": NaN}}', None),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),  # prompt + max_tokens past the context (1024)
    ({"prompt": [5] * 1000, "max_tokens": 100}, "max_tokens"),
    ({"prompt": [1, -1, 3]}, None),
    ({"prompt": [1, 10**30]}, None),
    ({"prompt": [5] * 1100}, None),
    ({"stop_token_ids": [-1]}, None),
    ({"allowed_token_ids": [10**30]}, None),
    ({"n": 10**6}, "n"),
    ({"top_k": 2**70}, None),
    ('{"prompt": "hi", "bad_words": ["\\udcff"]}', None),
    ('{"prompt": "\\ud800 lone"}', None),
    ({"vllm_xargs": {"fail": {"nested": "objects"}}}, None),
]


@pytest.mark.parametrize("body, param", HOSTILE_BODIES, ids=[str(i) for i in range(len(HOSTILE_BODIES))])
def test_hostile_bodies_get_a_400_and_the_engine_keeps_serving(hostile_server, body, param):
    if isinstance(body, str):
        response = httpx.post(
            hostile_server.url + "/v1/completions",
            content=body.encode(),
            timeout=60,
            headers={**AUTH, "content-type": "application/json"},
        )
    else:
        response = completion(hostile_server, AUTH, **body)
    assert_openai_error(response, 400, param)
    assert_serving(hostile_server, AUTH)


def test_hostile_chat_bodies(hostile_server):
    url = hostile_server.url + "/v1/chat/completions"
    surrogate = b'{"messages": [{"role": "user", "content": "\\udcff"}]}'
    assert_openai_error(httpx.post(url, content=surrogate, headers={**AUTH, "content-type": "application/json"}), 400)
    too_long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    assert_openai_error(httpx.post(url, json=too_long, headers=AUTH), 400, "max_tokens")
    assert_serving(hostile_server, AUTH)


def test_a_request_that_fails_in_the_engine_fails_alone_over_http(hostile_server):
    url = hostile_server.url

    async def run():
        normal = [
            read_stream(url, {"prompt": f"client {i}", "max_tokens": 24, "ignore_eos": True}, AUTH) for i in range(6)
        ]
        failing_stream = read_stream(url, {"prompt": "break", "max_tokens": 24, "vllm_xargs": {"fail": True}}, AUTH)
        async with httpx.AsyncClient(timeout=120) as http:
            failing = http.post(
                url + "/v1/completions",
                headers=AUTH,
                json={"prompt": "break too", "max_tokens": 24, "vllm_xargs": {"fail": True}},
            )
            return await asyncio.gather(failing, failing_stream, *normal)

    failing, failing_stream, *normal = asyncio.run(run())
    error = assert_openai_error(failing, 500)
    assert error["type"] == "EngineGenerateError" and "faulty processor" in error["message"]
    assert failing_stream["done"] and failing_stream["error"]["type"] == "EngineGenerateError"
    assert all(r["done"] and r["error"] is None and stream_tokens(r) == 24 for r in normal), normal
    assert_drained(hostile_server)
    assert_serving(hostile_server, AUTH)


def test_api_key_scheme_is_case_insensitive(hostile_server):
    models = hostile_server.url + "/v1/models"
    assert httpx.get(models, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(models, headers={"Authorization": f"BEARER  {KEY}"}).status_code == 200
    assert_openai_error(httpx.get(models, headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_openai_error(httpx.get(models, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.get(models), 401)


def test_bodies_past_the_limit_get_413(hostile_server):
    big = json.dumps({"prompt": "x" * (9 * 1024**2)}).encode()
    response = httpx.post(
        hostile_server.url + "/v1/completions",
        content=big,
        timeout=60,
        headers={**AUTH, "content-type": "application/json"},
    )
    assert_openai_error(response, 413)
    assert_serving(hostile_server, AUTH)


def test_a_long_prompt_is_tokenized_off_the_event_loop(hostile_server):
    """A 5 MB prompt takes seconds to tokenize; /health must answer meanwhile."""
    result = {}

    def send():
        result["response"] = completion(hostile_server, AUTH, prompt="lorem ipsum dolor " * 280_000)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.3)
    latencies = []
    while sender.is_alive() and len(latencies) < 20:
        start = time.monotonic()
        assert httpx.get(hostile_server.url + "/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    sender.join()
    assert len(latencies) >= 3, "the prompt was tokenized too fast to measure anything"
    assert max(latencies) < 1.0, latencies  # tokenized on the event loop, it stalled for 1.6-3.5 s
    assert "context length" in assert_openai_error(result["response"], 400)["message"]


def abandon_non_streaming(
    srv: Server, headers: dict, count: int = 6, max_tokens: int = 900, hang_up_after: float = 0.4
) -> None:
    """Non-streaming requests whose clients hang up (after ``hang_up_after`` s) must stop generating."""
    before = metrics(srv)

    async def one(index: int) -> None:
        async with httpx.AsyncClient(timeout=hang_up_after) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    srv.url + "/v1/completions",
                    headers=headers,
                    json={"prompt": f"abandoned {index}", "max_tokens": max_tokens, "ignore_eos": True},
                )

    async def run():
        await asyncio.gather(*(one(i) for i in range(count)))

    asyncio.run(run())
    assert_drained(srv, timeout=10)
    after = metrics(srv)
    generated = after["engine_generation_tokens_total"] - before["engine_generation_tokens_total"]
    assert generated < count * max_tokens / 2, generated  # the aborts stopped them early
    assert after["engine_request_success_total"] == before["engine_request_success_total"]  # none counted as served


def test_abandoned_non_streaming_requests_are_aborted_with_the_api_key(hostile_server):
    abandon_non_streaming(hostile_server, AUTH)


def test_api_server_sigkill_takes_every_process_along(hostile_server):
    """Last use of this server: SIGKILL it under load; the core ends by itself and removes its IPC folder."""
    procs = hostile_server.descendants()
    assert procs and ipc_dirs(hostile_server.tmp)

    async def load():
        return await asyncio.gather(
            *(
                read_stream(
                    hostile_server.url, {"prompt": f"x{i}", "max_tokens": 500, "ignore_eos": True}, AUTH, timeout=20
                )
                for i in range(4)
            ),
            return_exceptions=True,
        )

    loader = threading.Thread(target=lambda: asyncio.run(load()))
    loader.start()
    time.sleep(1.5)
    hostile_server.proc.kill()
    loader.join(30)
    assert wait_until(lambda: not alive(procs), 15), alive(procs)
    assert ipc_dirs(hostile_server.tmp) == []


# ---- a server under pressure (no API key, a small KV cache) --------------------------------------------
@pytest.fixture(scope="module")
def pressure_server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pressure-tmp")
    srv = Server(
        "--model",
        tiny_llama,
        "--dtype",
        "float32",
        "--num-gpu-blocks-override",
        "48",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "64",
        "--shutdown-grace-period",
        "4",
        env={"TMPDIR": str(tmp)},
    )
    srv.tmp = tmp
    yield srv
    srv.stop()


def test_abandoned_non_streaming_requests_are_aborted_without_the_api_key(pressure_server):
    # max_model_len 512 caps the length: hang up early, a fast machine generates 480 tokens in about a second
    abandon_non_streaming(pressure_server, {}, count=4, max_tokens=480, hang_up_after=0.3)


def test_kv_pressure_preempts_and_loses_nothing(pressure_server):
    before = metrics(pressure_server)["engine_num_preemptions"]

    async def run():
        return await asyncio.gather(
            *(
                read_stream(pressure_server.url, {"prompt": f"pressure {i} " * 8, "max_tokens": 48, "ignore_eos": True})
                for i in range(24)
            )
        )

    results = asyncio.run(run())
    assert all(r["done"] and r["error"] is None and stream_tokens(r) == 48 for r in results), [
        (i, r["done"], r["error"], stream_tokens(r))
        for i, r in enumerate(results)
        if not (r["done"] and r["error"] is None and stream_tokens(r) == 48)
    ]
    assert metrics(pressure_server)["engine_num_preemptions"] > before
    assert_drained(pressure_server)


def test_300_clients_hanging_up_at_once(pressure_server):
    async def run():
        return await asyncio.gather(
            *(
                read_stream(
                    pressure_server.url, {"prompt": f"bye {i}", "max_tokens": 200, "ignore_eos": True}, stop_after=1
                )
                for i in range(300)
            ),
            return_exceptions=True,
        )

    results = asyncio.run(run())
    assert sum(1 for r in results if isinstance(r, dict) and r["status"] == 200) >= 250, results[:3]
    assert_drained(pressure_server, timeout=60)
    assert_serving(pressure_server)


def test_a_frozen_core_resumes_and_its_clients_finish(pressure_server):
    core = engine_core_of(pressure_server)

    async def run():
        streams = [
            asyncio.create_task(
                read_stream(pressure_server.url, {"prompt": f"frozen {i}", "max_tokens": 64, "ignore_eos": True})
            )
            for i in range(4)
        ]
        await asyncio.sleep(0.5)
        core.suspend()
        await asyncio.sleep(2.0)
        core.resume()
        return await asyncio.wait_for(asyncio.gather(*streams), 60)

    results = asyncio.run(run())
    assert all(r["done"] and r["error"] is None and stream_tokens(r) == 64 for r in results)
    assert_drained(pressure_server)
    assert_serving(pressure_server)


def test_sigterm_under_load_ends_each_stream_with_an_error_event(pressure_server):
    """Last use of this server: streams in flight get the grace period, then an error event and [DONE]."""
    procs = pressure_server.descendants()
    results = {}

    def load():
        # 32 streams of 480 tokens in 48 KV blocks (one full-length stream fits at a time): far more work than the
        # 1.5 s + 4 s grace period, even on a fast AVX-512 machine (12 streams all finished in time there)
        async def run():
            return await asyncio.gather(
                *(
                    read_stream(
                        pressure_server.url, {"prompt": f"long {i}", "max_tokens": 480, "ignore_eos": True}, timeout=30
                    )
                    for i in range(32)
                ),
                return_exceptions=True,
            )

        results["streams"] = asyncio.run(run())

    def in_flight() -> bool:  # the streams reached the server (a slow machine takes seconds to open 32)
        m = metrics(pressure_server)
        return m["engine_num_requests_running"] + m["engine_num_requests_waiting"] >= 16

    loader = threading.Thread(target=load)
    loader.start()
    assert wait_until(in_flight, 60, 0.1), metrics(pressure_server)
    time.sleep(0.5)
    start = time.monotonic()
    pressure_server.proc.send_signal(signal.SIGTERM)
    assert pressure_server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
    assert time.monotonic() - start < 12
    loader.join(30)
    streams = results["streams"]
    assert all(isinstance(r, dict) and r["done"] for r in streams), streams  # no connection was cut
    cut = [r for r in streams if r["error"] is not None]
    assert cut and all(r["error"]["code"] == 503 and "shutting down" in r["error"]["message"] for r in cut)
    assert all(stream_tokens(r) == 480 for r in streams if r["error"] is None)
    assert wait_until(lambda: not alive(procs), 10), alive(procs)
    assert ipc_dirs(pressure_server.tmp) == []
    assert "leaked semaphore" not in pressure_server.output()


# ---- deaths: a worker, the core ------------------------------------------------------------------------
def assert_fail_stop(srv: Server, kill) -> None:
    """With restarts off, a death under load: every stream ends with a 503 error event (no connection cut),
    then the server exits with status 1 and one line saying why."""

    async def run():
        received = [[] for _ in range(4)]
        streams = [
            asyncio.create_task(
                read_stream(
                    srv.url, {"prompt": f"victim {i}", "max_tokens": 500, "ignore_eos": True}, events=received[i]
                )
            )
            for i in range(4)
        ]
        await wait_for_async(lambda: all(received), 60)  # every stream under way, none near its 500 tokens
        kill()
        start = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*streams), 15)
        return results, time.monotonic() - start

    results, elapsed = asyncio.run(run())
    assert elapsed < 10
    assert all(r["done"] and r["error"]["code"] == 503 for r in results), results
    assert srv.proc.wait(30) == 1
    assert srv.output().count("stopping the server") == 1, srv.output()


def test_worker_sigkill_with_tensor_parallel_2_and_restarts_off(tiny_llama, tmp_path):
    srv = Server(
        "--model",
        tiny_llama,
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "2",
        "--max-restarts",
        "0",
        env={"TMPDIR": str(tmp_path)},
    )
    try:
        procs = srv.descendants()
        workers = engine_core_of(srv).children()
        assert len(workers) == 2
        assert_fail_stop(srv, workers[1].kill)
        assert "killed by signal SIGKILL" in srv.output() and "exit code None" not in srv.output()
        assert "not restarted (0 of 0 restarts within 600 s already)" in srv.output()
    finally:
        srv.stop()
    assert wait_until(lambda: not alive(procs), 10), alive(procs)
    assert ipc_dirs(tmp_path) == []
    assert "leaked semaphore" not in srv.output()


# the engine core's own death under load, restarted: test_failover


# ---- start-up failures ---------------------------------------------------------------------------------
def test_sigterm_while_the_model_loads_leaves_no_process_and_no_ipc_folder(tiny_llama, tmp_path):
    srv = Server(
        "--model",
        tiny_llama,
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "2",
        env={"TMPDIR": str(tmp_path)},
        wait_healthy=False,
    )
    try:
        core = engine_core_of(srv)
        assert wait_until(lambda: len(core.children()) >= 1, 60)  # workers spawned: loading is under way
        procs = srv.descendants()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        srv.stop()
    assert wait_until(lambda: not alive(procs), 15), alive(procs)
    assert ipc_dirs(tmp_path) == []


def test_sigkill_while_the_model_loads_takes_the_core_along(tiny_llama, tmp_path):
    srv = Server("--model", tiny_llama, "--dtype", "float32", env={"TMPDIR": str(tmp_path)}, wait_healthy=False)
    try:
        engine_core_of(srv)
        procs = srv.descendants()
        srv.proc.kill()
    finally:
        srv.stop()
    assert wait_until(lambda: not alive(procs), 15), alive(procs)
    assert wait_until(lambda: ipc_dirs(tmp_path) == [], 5)


def test_a_port_in_use_exits_at_once_with_one_clear_line(tiny_llama, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = Server("--model", tiny_llama, port=port, env={"TMPDIR": str(tmp_path)}, wait_healthy=False)
        try:
            assert srv.proc.wait(60) == 1
        finally:
            srv.stop()
    lines = [line for line in srv.output().splitlines() if line.strip()]
    assert lines == [f"engine serve: cannot listen on 127.0.0.1:{port}: Address already in use"], lines
    assert ipc_dirs(tmp_path) == []
