"""The web console at `/` and `GET /v1/engine/status`, tested in a real headless Chromium driven by Playwright: the
page loads with no console errors, a chat message streams an answer (logprobs on hover), the live view's numbers
move while a load runs, the plugin table names the chosen attention backend, the API key is asked for and sent,
and the page is usable from the keyboard and on a narrow window. Screenshots go to docs/figures/console_*.png."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import Server

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [  # as this machine needs it: no sandbox as root, no network chatter to hosts it cannot reach
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
]

needs_browser = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="no Chromium here (scripts/install.sh installs Debian's chromium; CI always has it)",
)


def test_status_endpoint_reports_the_engine(features_server):
    status = httpx.get(features_server.url + "/v1/engine/status", timeout=30).json()
    assert status["model"] == "tiny" and status["requests"] == {"running": 0, "waiting": 0}
    assert 0 <= status["kv_cache"]["usage"] <= 1 and status["kv_cache"]["total_blocks"] > 0
    kinds = {p["kind"]: p for p in status["plugins"]}
    assert {"attention", "executor", "kv_cache_coordinator", "sampler"} <= set(kinds)
    attention = kinds["attention"]
    assert attention["why"] and attention["source"] and all("name" in o and "reason" in o for o in attention["others"])
    assert any(not o["available"] and o["reason"] for o in attention["others"])  # flash: no CUDA device here
    assert len(status["dp_ranks"]) == 1 and status["spec_decoding"] is None and status["shadow"] is None
    for table in status["product_tables"].values():  # the cpu kernels measure their products at start-up
        assert table["table"] and {"shape", "bucket", "chosen"} <= set(table["table"][0])


def test_status_rates_and_history_follow_a_load(features_server):
    url = features_server.url
    before = httpx.get(url + "/v1/engine/status", timeout=30).json()
    body = {"prompt": "count", "max_tokens": 40, "ignore_eos": True, "n": 4}
    assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
    deadline, status = time.monotonic() + 10, before
    while time.monotonic() < deadline:  # the sampler takes one sample a second
        status = httpx.get(url + "/v1/engine/status", timeout=30).json()
        if any(point["generation_tokens_per_s"] > 0 for point in status["history"]):
            break
        time.sleep(0.5)
    assert status["totals"]["generated_tokens"] >= before["totals"]["generated_tokens"] + 160
    busy = [p for p in status["history"] if p["steps_per_s"] > 0]
    assert busy and all(p["mean_step_ms"] > 0 and p["mean_batch_size"] >= 1 for p in busy)
    assert status["history"][-1]["t"] <= 0


def test_disable_console_leaves_out_the_page_but_not_the_status(tiny_llama):
    from fastapi.testclient import TestClient

    from engine.config import VllmConfig
    from engine.entrypoints.openai.api_server import build_app

    app = build_app(VllmConfig.load(model=tiny_llama, disable_console=True))
    client = TestClient(app)  # no lifespan: no engine, only the routes
    page = client.get("/")
    assert page.status_code == 404 and page.json()["error"]["code"] == 404
    assert client.get("/v1/engine/status").status_code == 503  # still routed: the engine is not loaded
    enabled = TestClient(build_app(VllmConfig.load(model=tiny_llama)))
    assert enabled.get("/").status_code == 200 and "engine console" in enabled.get("/").text
    assert enabled.get("/console/console.js").headers["content-type"].startswith("text/javascript")
    assert enabled.get("/console/../config.py").status_code == 404


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def open_console(browser, url: str, width: int = 1280, height: int = 900):
    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/")
    return page, errors


@needs_browser
def test_console_chat_streams_and_the_live_view_moves(browser, features_server):
    url = features_server.url
    page, errors = open_console(browser, url)
    page.wait_for_function("document.getElementById('server-state').textContent.includes('tiny')")
    chosen = {p["kind"]: p["chosen"] for p in httpx.get(url + "/v1/engine/status", timeout=30).json()["plugins"]}
    page.wait_for_function(
        "(name) => [...document.querySelectorAll('#plugins tbody tr')].some("
        "r => r.cells[0].textContent === 'attention' && r.cells[1].textContent === name)",
        arg=chosen["attention"],
    )
    # every control has a label, and nothing is wider than the window
    unlabeled = page.evaluate(
        "[...document.querySelectorAll('input, select, textarea')].filter(e => !e.labels.length).map(e => e.id)"
    )
    assert unlabeled == []

    # chat: typed and sent from the keyboard, streamed in pieces, each token's logprob on hover
    page.click("summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.evaluate(
        "window.pieces = 0; new MutationObserver(m => window.pieces += m.length)"
        ".observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true})"
    )
    page.focus("#prompt")
    page.keyboard.type("Hello there")
    page.keyboard.press("Enter")
    page.wait_for_function("document.getElementById('chat-status').textContent.startsWith('done')", timeout=60000)
    answer = page.inner_text(".msg.assistant .body")
    expected = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 24, "temperature": 0},
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    assert answer == expected and answer
    assert page.evaluate("window.pieces") > 5  # the answer grew token by token
    title = page.get_attribute(".msg.assistant .tok", "title")
    assert title is not None and title.startswith("logprob ") and "top:" in title
    page.keyboard.press("Shift+Tab")  # back from the prompt... and forward again to the send button
    page.focus("#prompt")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "send"

    # the live view's numbers move while a load runs
    page.wait_for_function("Number(document.getElementById('chart-span').textContent) >= 6")  # some history first
    generated = int(page.inner_text("#generated"))
    load = threading.Thread(
        target=lambda: httpx.post(
            url + "/v1/completions",
            json={"prompt": "load", "max_tokens": 192, "n": 8, "ignore_eos": True},
            timeout=120,
        )
    )
    load.start()
    page.wait_for_function(
        "(before) => Number(document.getElementById('generated').textContent) > before + 100", arg=generated
    )
    page.wait_for_function("Number(document.getElementById('output-rate').textContent) > 0")
    page.wait_for_function("document.querySelectorAll('#chart polyline').length === 2")
    FIGURES.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(FIGURES / "console_wide.png"), full_page=True)
    load.join()
    assert errors == []


@needs_browser
def test_console_on_a_narrow_window(browser, features_server):
    page, errors = open_console(browser, features_server.url, width=420, height=900)
    page.wait_for_function("document.getElementById('server-state').textContent.includes('tiny')")
    page.wait_for_function("document.querySelectorAll('#plugins tbody tr').length > 0")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert page.is_visible("#prompt") and page.is_visible("#running")
    page.screenshot(path=str(FIGURES / "console_narrow.png"), full_page=True)
    assert errors == []


@needs_browser
def test_console_asks_for_the_api_key_and_sends_it(browser, tiny_llama):
    server = Server(
        "--model",
        tiny_llama,
        "--served-model-name",
        "keyed",
        "--dtype",
        "float32",
        "--api-key",
        "sekret",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
    )
    try:
        page, errors = open_console(browser, server.url)
        page.wait_for_selector("#key-form", state="visible")
        assert "API key" in page.inner_text("#server-state")
        page.fill("#api-key", "sekret")
        page.keyboard.press("Enter")
        page.wait_for_function("document.getElementById('server-state').textContent.includes('keyed')")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
        # the refused calls before the key are the only errors the browser logged
        assert all("401" in error for error in errors), errors
    finally:
        server.stop()


def test_history_turns_counters_into_rates_and_a_chart():
    from engine.entrypoints.openai.engine_status import StatusHistory
    from engine.messages import SchedulerStats, StepCounters

    clock = [100.0]
    history = StatusHistory(clock=lambda: clock[0])
    assert history.latest_rates()["generation_tokens_per_s"] == 0.0 and history.chart() == []
    for second, (steps, seconds, requests, prompt, generated) in enumerate(
        [(0, 0.0, 0, 0, 0), (10, 0.5, 40, 300, 40), (30, 1.5, 120, 300, 120)]
    ):
        clock[0] = 100.0 + second
        history.add(
            SchedulerStats(4, 1, 0.5, 10, 20, 0, 0, 0, steps=StepCounters(steps, seconds, requests, prompt, generated))
        )
    first, second = history.chart()
    assert first == {
        "t": -1.0,
        "prompt_tokens_per_s": 300.0,
        "generation_tokens_per_s": 40.0,
        "steps_per_s": 10.0,
        "mean_step_ms": 50.0,
        "mean_batch_size": 4.0,
        "running": 4,
        "waiting": 1,
        "kv_cache_usage": 0.5,
    }
    assert second["t"] == 0.0 and second["mean_step_ms"] == 50.0 and second["generation_tokens_per_s"] == 80.0
    assert history.latest_rates()["generation_tokens_per_s"] == 60.0  # over the last samples: 120 tokens in 2 s
    ranks = [SchedulerStats(1, 0, 0.1, 1, 2, 0, 0, 0, steps=StepCounters(2, 0.5, 3, 4, 5)) for _ in range(2)]
    assert SchedulerStats.total(ranks).steps == StepCounters(4, 1.0, 6, 8, 10)


def test_the_sampler_stops_when_its_cancellation_meets_a_finished_sample():
    """Found by CI: `engine serve` sometimes outlived SIGTERM by 30 s, its shutdown waiting for the status sampler.
    Python 3.11's ``wait_for`` drops a cancellation that arrives as the awaited sample completes; the sampler then
    sampled on. ``stop`` must end it whenever the cancellation lands."""
    import asyncio

    from engine.entrypoints.openai.engine_status import StatusHistory
    from engine.messages import SchedulerStats

    class Engine:
        def __init__(self):
            self.samples = 0
            self.pending: asyncio.Future | None = None

        async def get_stats(self):
            self.samples += 1
            self.pending = asyncio.get_running_loop().create_future()
            return await self.pending

    async def scenario() -> int:
        engine, history = Engine(), StatusHistory()
        history.start(engine)
        while engine.pending is None:
            await asyncio.sleep(0)
        engine.pending.set_result(SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0))  # the sample completes...
        await asyncio.sleep(0)  # ...wait_for's inner task takes it
        await asyncio.wait_for(history.stop(), timeout=10)  # ...and the cancellation arrives now
        return engine.samples

    samples: list[int] = []  # in a thread of its own: the browser tests leave an event loop running in this one
    runner = threading.Thread(target=lambda: samples.append(asyncio.run(scenario())))
    runner.start()
    runner.join(timeout=60)
    assert samples == [1]
