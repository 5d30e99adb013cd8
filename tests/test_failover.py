"""Engine cores that die or wedge (issue 38 items 1 and 2): restarts, migration to the ranks that are up, health.

Pieces first (the restart policy, the router leaving a rank out, a resumed request continuing a sequence), then
processes: AsyncLLM over two DP ranks losing one to SIGKILL and the other to SIGSTOP under streaming load, then
`engine serve` restarting its one engine core, and ending once its restart budget is spent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from engine import LLM, AsyncLLM, SamplingParams
from engine.config import VllmConfig
from engine.messages import EngineCoreRequest
from engine.processes.restart_policy import RestartPolicy
from tests.helpers import Server, alive, random_prompts, wait_until
from tests.test_data_parallel import make_router, request
from tests.test_faults import read_stream

PROMPTS = random_prompts(4, (8, 40), seed=88)


# ---- pieces ---------------------------------------------------------------------------------------------
def test_restart_policy_backs_off_and_gives_up_within_its_window():
    now = [0.0]
    policy = RestartPolicy(max_restarts=3, window_s=100, clock=lambda: now[0])
    assert [policy.grant(0), policy.grant(0), policy.grant(0)] == [1.0, 2.0, 4.0]
    assert policy.grant(0) is None  # the budget of rank 0 is spent ...
    assert policy.grant(1) == 1.0  # ... not rank 1's
    now[0] = 101.0  # the window moved past the first three
    assert policy.grant(0) == 1.0
    assert RestartPolicy(0, 100).grant(0) is None  # fail-stop


def test_router_leaves_a_dead_rank_out_until_it_is_back():
    router = make_router("prefix_aware")
    shared = list(range(64))
    first = router.route(request("a", shared + [1]))
    router.mark_down(first)
    assert [router.route(request(f"b{i}", shared + [i + 2])) for i in range(4)] == [1 - first] * 4
    router.mark_down(1 - first)
    with pytest.raises(ValueError, match="no DP rank is up"):
        router.route(request("c", [1, 2, 3]))
    router.mark_up(first)
    assert router.route(request("d", [1, 2, 3])) == first


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_the_sequence_it_was_cut_from(tiny_llama, sampling):
    """What a migration sends a live rank: prompt + the tokens the client has, as ``resumed_output_token_ids``.
    The core gives the rest of the same sequence, greedy or seeded (the seed counts the resumed tokens)."""
    llm = LLM(tiny_llama, dtype="float32")
    core = llm.llm_engine.engine_core.engine_core
    params = SamplingParams(**sampling, max_tokens=24, ignore_eos=True)

    def run(request_id: str, resumed: list[int]) -> list[int]:
        core.add_request(EngineCoreRequest(request_id, PROMPTS[0], params, None, time.monotonic(), None, resumed))
        tokens: list[int] = []
        while core.scheduler.has_unfinished_requests():
            for output in core.step().outputs:
                assert output.error is None, output.error
                tokens += output.new_token_ids
        return tokens

    whole = run("whole", [])
    assert len(whole) == 24
    for cut in (1, 9, 23):
        assert run(f"resumed-{cut}", whole[:cut]) == whole[cut:], cut
    stats = core.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    llm.shutdown()


# ---- AsyncLLM over two DP ranks -------------------------------------------------------------------------
def test_dp_ranks_killed_and_wedged_under_streaming_load_lose_and_repeat_no_token(tiny_llama):
    """Two ranks, four streams (greedy and seeded). Rank 1 is SIGKILLed: its streams move to rank 0 and go on
    from the tokens they had, with the tokens they give alone; rank 1 restarts and takes requests again. Then
    rank 0 is frozen (SIGSTOP): after ``engine_stall_timeout_s`` it is killed as wedged and the same happens.
    Batch-invariant, so that "the tokens they give alone" is exact for the sampled streams too: a stream under
    fault shares its steps with others and its resumed context is recomputed as a prompt, and a seeded draw that
    falls within a rounding of two tokens' boundary (seed 11 at token 101 on one AVX-512 machine) would part."""
    max_tokens = 120
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True),
    ]

    async def run():
        engine = AsyncLLM(
            VllmConfig.load(
                model=tiny_llama,
                dtype="float32",
                data_parallel_size=2,
                data_parallel_routing="least_loaded",
                engine_stall_timeout_s=4,
                batch_invariant=True,
            )
        )
        client = engine.engine_core
        first_pids = list(client.engines.pids)

        async def collect(index: int, request_id: str, seen: list) -> list[int]:
            tokens: list[int] = []
            async for output in engine.generate({"prompt_token_ids": PROMPTS[index]}, params[index], request_id):
                now = output.outputs[0].token_ids
                assert now[: len(tokens)] == tokens  # cumulative: nothing taken back, nothing repeated
                tokens = list(now)
                seen[index] = len(tokens)
            return tokens

        alone = [await collect(i, f"alone-{i}", [0] * 4) for i in range(4)]

        async def under_fault(name: str, fault) -> list[list[int]]:
            seen = [0] * 4
            tasks = [asyncio.create_task(collect(i, f"{name}-{i}", seen)) for i in range(4)]
            deadline = time.monotonic() + 60
            while not (all(seen) and {e.rank for e in client.in_flight.values()} == {0, 1}):
                assert time.monotonic() < deadline, (seen, client.in_flight)
                await asyncio.sleep(0.01)
            assert max(seen) < max_tokens // 2, seen  # all under way, far from done
            fault()
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        async def both_ranks_up():
            deadline = time.monotonic() + 120
            while engine.health()["dp_ranks_alive"] < 2:
                assert time.monotonic() < deadline, engine.health()
                await asyncio.sleep(0.1)

        killed = await under_fault("kill", lambda: os.kill(first_pids[1], signal.SIGKILL))
        after_kill = engine.health()
        await both_ranks_up()
        frozen_pid = client.engines.pids[0]
        frozen = await under_fault("freeze", lambda: os.kill(frozen_pid, signal.SIGSTOP))
        await both_ranks_up()
        report = engine.health()
        pids = list(client.engines.pids)
        stats = await engine.get_stats()
        engine.shutdown()
        return alone, killed, after_kill, frozen, report, first_pids, pids, stats

    alone, killed, after_kill, frozen, report, first_pids, pids, stats = asyncio.run(run())
    assert killed == alone and frozen == alone
    assert after_kill["requests_migrated"] >= 1 and after_kill["engine_core_deaths"] == 1
    assert report["status"] == "ok" and report["engine_core_deaths"] == 2 and report["engine_core_restarts"] == 2
    assert report["requests_migrated"] >= 2
    assert pids[0] != first_pids[0] and pids[1] != first_pids[1]  # both ranks run a new core
    assert len(stats.per_rank) == 2 and all(r.num_free_blocks == r.num_total_blocks for r in stats.per_rank)
    assert wait_until(lambda: alive([psutil.Process(p) for p in pids if psutil.pid_exists(p)]) == [], 15)


def test_offline_dp_llm_moves_a_killed_ranks_requests_and_gets_it_back(tiny_llama):
    """``LLM(data_parallel_size=2)`` (the blocking client, whose reader thread does the failover): a rank killed
    mid-generation; every request still ends with its full greedy sequence, and the rank is restarted."""
    llm = LLM(tiny_llama, dtype="float32", data_parallel_size=2, data_parallel_routing="least_loaded")
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.llm_engine
    client = engine.engine_core
    ids = [engine.add_request(p, params) for p in prompts]
    finished = {}
    while not (all(client.up) and {e.rank for e in client.in_flight.values()} == {0, 1}):
        for output in engine.step():
            assert not output.finished, "a request finished before both ranks were busy"
    first_pid = client.engines.pids[1]
    os.kill(first_pid, signal.SIGKILL)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                finished[output.request_id] = output.outputs[0].token_ids
    assert [finished[i] for i in ids] == alone
    assert wait_until(lambda: client.health()["dp_ranks_alive"] == 2, 120, 0.2), client.health()
    assert client.engines.pids[1] != first_pid and client.num_migrated >= 1
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == alone
    llm.shutdown()


# ---- `engine serve` with one engine core ---------------------------------------------------------------
def test_served_core_restarts_once_then_the_server_ends_when_its_budget_is_spent(tiny_llama, tmp_path):
    """DP=1, ``--max-restarts 1``: the core is stopped (SIGTERM: it exits through its own clean-up, which must
    leave the IPC folder to the restarted core). The streams in it end with a 503 error event saying they were
    lost; /health is 503 until the new core is loaded, then 200, and requests are served again. A second death
    (SIGKILL) spends the budget: the server exits with status 1 and one line saying why, and leaves no
    process and no IPC folder."""
    srv = Server("--model", tiny_llama, "--dtype", "float32", "--max-restarts", "1", env={"TMPDIR": str(tmp_path)})
    try:
        core = next(p for p in psutil.Process(srv.proc.pid).children() if p.name().startswith("EngineCore"))

        async def streams_through(kill) -> list[dict]:
            received: list[list] = [[] for _ in range(3)]
            tasks = [
                asyncio.create_task(
                    read_stream(
                        srv.url, {"prompt": f"victim {i}", "max_tokens": 400, "ignore_eos": True}, events=received[i]
                    )
                )
                for i in range(3)
            ]
            deadline = time.monotonic() + 60
            while not all(received):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), 30)

        results = asyncio.run(streams_through(core.terminate))
        for result in results:
            assert result["done"] and result["error"]["code"] == 503, result["error"]
            assert "lost" in result["error"]["message"] and "process ended" in result["error"]["message"]
        assert wait_until(lambda: httpx.get(srv.url + "/health", timeout=10).status_code == 503, 10)
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        if refused.status_code == 503:  # restarting: the OpenAI error body says so, with Retry-After
            assert refused.json()["error"]["type"] == "ServiceUnavailableError" and refused.headers["retry-after"]
        srv.wait_for(200, timeout=120)
        report = httpx.get(srv.url + "/health?verbose=1", timeout=10).json()
        assert report["status"] == "ok" and report["engine_core_restarts"] == 1, report
        assert report["ranks"] == [{"rank": 0, "state": "up"}]
        response = httpx.post(srv.url + "/v1/completions", json={"prompt": "again", "max_tokens": 5}, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert 'engine_core_restarts{model_name="' in metrics and "engine_dp_ranks_alive" in metrics

        procs = srv.descendants()
        new_core = next(p for p in psutil.Process(srv.proc.pid).children() if p.name().startswith("EngineCore"))
        assert new_core.pid != core.pid
        new_core.kill()
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    output = srv.output()
    assert output.count("stopping the server") == 1, output
    assert "(killed by signal SIGKILL); not restarted (1 of 1 restarts within 600 s already)" in output
    assert wait_until(lambda: not alive(procs), 15), alive(procs)
    assert not list(tmp_path.glob("engine-ipc-*"))
