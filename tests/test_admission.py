"""Bounded admission (`--max-waiting-requests`, `--max-waiting-tokens`): an overloaded server refuses new calls at
once with 503, Retry-After and an OpenAI error body, counts them in /metrics, and loses nothing it accepted."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from engine.entrypoints.openai.admission import STALE_RESERVATION_S, AdmissionControl, OverloadedError
from tests.helpers import Server, wait_until
from tests.test_server import metric

MODEL_NAME = "tiny-llama"
HOLD_TOKENS = 16000  # the request that holds the only running slot: never ends before the test aborts it


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_caps_refuse_whole_calls_and_always_admit_when_nothing_waits():
    refused = []
    clock = Clock()
    control = AdmissionControl(2, 100, on_refused=refused.append, clock=clock)
    control.admit([("big", 500)])  # nothing waits: a prompt larger than the token cap is still served
    with pytest.raises(OverloadedError) as exc:
        control.admit([("small", 1)])  # 500 tokens wait: past the token cap
    assert exc.value.status == 503 and exc.value.headers == {"Retry-After": "1"}
    assert "max_waiting_tokens 100" in str(exc.value)
    control.started("big")
    clock.now += 3.0
    control.first_output("big")  # waited 3 s for its first token
    control.admit([("a", 10)])
    control.admit([("b", 10)])
    with pytest.raises(OverloadedError, match="2 requests wait for their first token") as exc:
        control.admit([("c", 10)])
    assert exc.value.headers == {"Retry-After": "3"}  # the median wait of the admitted requests
    with pytest.raises(OverloadedError):
        control.admit([("d", 1), ("e", 1)])
    assert refused == ["waiting_tokens", "waiting_requests", "waiting_requests"]
    control.release("a")  # a request that ends (or fails, or is cancelled) before its first output
    control.admit([("c", 10)])
    assert set(control.waiting) == {"b", "c"}
    # a reservation whose request never started (its client left before the stream began) is dropped in time
    clock.now += STALE_RESERVATION_S + 1
    control.started("c")
    control.admit([("f", 10)])
    assert set(control.waiting) == {"c", "f"}


def test_without_caps_everything_is_admitted():
    control = AdmissionControl(None, None)
    for index in range(1000):
        control.admit([(str(index), 10**6)])
    assert not control.enabled and control.waiting == {}


@pytest.fixture(scope="module")
def bounded_server(make_tiny_model):
    # one request runs at a time: the others wait for their first token as long as it runs. A context of 16K lets
    # the request that holds the slot run for seconds on any CPU (1000 tokens, the tiny model's usual context, ended
    # within the test's window once a replayed decode step got faster)
    srv = Server(
        "--model",
        make_tiny_model(max_position_embeddings=HOLD_TOKENS + 384),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "32MiB",
        "--max-model-len",
        str(HOLD_TOKENS + 384),
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "2",
    )
    yield srv
    srv.stop()


def test_an_overloaded_server_answers_503_with_retry_after_and_loses_nothing_it_accepted(bounded_server):
    url = bounded_server.url + "/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "one two three", "temperature": 0, "ignore_eos": True}
    running = threading.Event()
    stop_running = threading.Event()

    def long_stream():  # holds the only running slot until told to leave
        with httpx.stream(
            "POST", url, json={**body, "max_tokens": HOLD_TOKENS, "stream": True}, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    running.set()
                if stop_running.is_set():
                    return  # closing the connection aborts it

    answers: list = []

    def waiting_call():
        answers.append(httpx.post(url, json={**body, "max_tokens": 4}, timeout=120))

    holder = threading.Thread(target=long_stream)
    holder.start()
    assert running.wait(60)
    waiting = [threading.Thread(target=waiting_call) for _ in range(2)]
    for thread in waiting:
        thread.start()
    # the two are admitted and wait behind the running request; a third call then finds the cap reached
    assert wait_until(lambda: metric(bounded_server, "engine_num_requests_waiting") == 2.0, 30)
    assert holder.is_alive()
    refused = httpx.post(url, json={**body, "max_tokens": 4}, timeout=30)
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "max_waiting_requests 2" in error["message"]
    assert metric(bounded_server, "engine_request_refused_total") >= 1
    stop_running.set()
    holder.join(60)
    for thread in waiting:
        thread.join(60)
    # every accepted call was served in full
    assert len(answers) == 2 and all(a.status_code == 200 for a in answers)
    assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
    # nothing stays reserved or in the KV cache: a new call is admitted and the cache empties
    assert httpx.post(url, json={**body, "max_tokens": 4}, timeout=60).status_code == 200
    assert wait_until(lambda: metric(bounded_server, "engine_kv_cache_usage_perc") == 0.0, 15)


def test_serve_bench_finds_the_sustainable_rate_and_counts_refusals_apart(bounded_server, tmp_path):
    """`engine bench serve --request-rate x1,x8 --slo-ttft-ms`: a saturating run finds the sustainable rate, the
    runs at its multiples report goodput and the calls the bounded server refused (503 + Retry-After), which are
    not failures (exit code 0)."""
    from tests.test_bench import engine, is_png

    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    result = engine(
        "bench",
        "serve",
        "--url",
        bounded_server.url,
        "--served-model",
        MODEL_NAME,
        "--num-prompts",
        "16",
        "--input-len",
        "16",
        "--output-len",
        "24",
        "--request-rate",
        "x1,x8",
        "--slo-ttft-ms",
        "60000",
        "--output",
        str(out),
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(out.read_text())["runs"]
    sustainable = runs[0]["sustainable_rate"]
    assert sustainable > 0 and [r["rate_multiple"] for r in runs] == [1.0, 8.0]
    assert [r["request_rate"] for r in runs] == pytest.approx([sustainable, 8 * sustainable])
    for run in runs:
        assert run["failed"] == 0 and run["completed"] + run["refused"] == 16
        assert run["goodput"] == pytest.approx(run["completed"] / run["duration_s"])  # every TTFT within 60 s
        assert run["slo_attained"] == pytest.approx(run["completed"] / 16)
    # 16 calls at 8x the rate one running slot sustains (a margin for a probe that ran slow), at most 2 waiting:
    # the server refused some
    assert runs[1]["refused"] > 0, runs
    assert is_png(plot) and is_png(tmp_path / "serve_goodput.png")
