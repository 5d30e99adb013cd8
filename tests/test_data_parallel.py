"""Data parallelism: one engine core per DP rank, the DP coordinator, routing, failures, API-server scale-out."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import time

import httpx
import psutil
import pytest

from engine import LLM, AsyncLLM, EngineDeadError, SamplingParams
from engine.config import ConfigError, VllmConfig
from engine.data_parallel.coordinator import DPCoordinator
from engine.data_parallel.prefix_summary import PrefixSummary, summary_bits
from engine.data_parallel.router import DPRouter
from engine.kv_cache.hashing import extend_block_hashes
from engine.messages import DPState, EngineCoreRequest, EngineLoad
from tests.helpers import Server, alive, hf_greedy, random_prompts, wait_until

PROMPTS = random_prompts(8, (5, 60), seed=41)
GREEDY = SamplingParams(temperature=0, max_tokens=10)


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


# ---- pieces without processes ---------------------------------------------------------------------------
def test_prefix_summary_never_misses_and_rarely_lies():
    rng = random.Random(0)
    held = [hashlib.sha256(rng.randbytes(8)).digest() for _ in range(2000)]
    other = [hashlib.sha256(rng.randbytes(8)).digest() for _ in range(20000)]
    summary = PrefixSummary.build(held, summary_bits(2000))
    assert all(h in summary for h in held)
    false_positive_rate = sum(h in summary for h in other) / len(other)
    assert false_positive_rate < 0.03, false_positive_rate
    assert summary.match_length(held[:5] + other[:1] + held[5:8]) == 5
    assert PrefixSummary.build([], summary_bits(10)).match_length(held[:3]) == 0
    with pytest.raises(ValueError):
        PrefixSummary(b"\0" * 3, 24)


def make_router(policy: str, ranks: int = 2, slack: int = 16) -> DPRouter:
    config = VllmConfig.load(
        data_parallel_size=ranks, data_parallel_routing=policy, block_size=16, data_parallel_balance_slack=slack
    )
    return DPRouter(config)


def request(request_id: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokens, GREEDY, None, 0.0)


def hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, 16)
    return out


def test_least_loaded_takes_the_lowest_waiting_x4_plus_running():
    router = make_router("least_loaded")
    router.update(DPState([EngineLoad(0, 0, 3, 0.1), EngineLoad(1, 1, 0, 0.1)]))  # scores 3 and 4
    assert router.route(request("a", list(range(40)))) == 0  # rank 0: 3 + 4 (sent since) = 7 now
    assert router.route(request("b", list(range(40)))) == 1
    spread = make_router("least_loaded")
    assert sorted(spread.route(request(f"r{i}", [i] * 20)) for i in range(6)) == [0, 0, 0, 1, 1, 1]


def test_prefix_aware_follows_the_rank_holding_the_prefix_until_it_is_overloaded():
    shared = list(range(1000, 1160))  # ten full blocks
    router = make_router("prefix_aware", slack=8)
    summary = PrefixSummary.build(hashes(shared), summary_bits(64))
    router.update(DPState([EngineLoad(0, 0, 0, 0.0), EngineLoad(1, 0, 0, 0.0, summary.bits, summary.num_bits)]))
    chosen = [router.route(request(f"s{i}", shared + [i] * 5)) for i in range(4)]
    assert chosen[:3] == [1, 1, 1]  # rank 1 holds the prefix; 3 waiting there = 12 > 0 + 8: overloaded
    assert chosen[3] == 0
    assert router.num_routed_by_prefix == 3
    # a prompt that shares only a short head (less than half its blocks) goes to the least loaded rank
    fresh = make_router("prefix_aware")
    fresh.update(DPState([EngineLoad(0, 0, 2, 0.0), EngineLoad(1, 0, 0, 0.0, summary.bits, summary.num_bits)]))
    fresh.update(DPState([EngineLoad(0, 0, 0, 0.0), EngineLoad(1, 0, 2, 0.0)]))  # summary kept, rank 1 busier
    assert fresh.route(request("head", shared[:32] + list(range(5000, 5100)))) == 0


def test_prefix_aware_keeps_a_burst_together_before_any_summary_arrives():
    router = make_router("prefix_aware")
    shared = list(range(2000, 2128))
    first = router.route(request("first", shared + [1]))
    assert all(router.route(request(f"b{i}", shared + [i + 2])) == first for i in range(3))
    other = router.route(request("other", list(range(7000, 7128))))
    assert other != first  # unrelated prompt: least loaded


def test_coordinator_keeps_a_rank_summary_that_a_report_does_not_repeat():
    coordinator = DPCoordinator(2)
    assert coordinator.due(10.0)  # heartbeat: never published
    coordinator.receive(EngineLoad(1, 2, 3, 0.5, b"\x01" * 128, 1024))
    coordinator.receive(EngineLoad(1, 0, 1, 0.25))
    state = coordinator.state(10.0)
    assert state.loads[0] is None and state.loads[1].num_running == 1 and state.loads[1].prefix_bits == b"\x01" * 128
    assert not coordinator.due(10.01)
    coordinator.receive(EngineLoad(0, 0, 0, 0.0))
    assert not coordinator.due(10.01) and coordinator.due(10.2)


def test_data_parallel_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="data_parallel_routing"):
        VllmConfig.load(data_parallel_routing="random")
    with pytest.raises(ConfigError, match="data_parallel_rank"):
        VllmConfig.load(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ConfigError, match="data_parallel_size"):
        VllmConfig.load(data_parallel_size=0)
    assert VllmConfig.load(data_parallel_size=2, tensor_parallel_size=2).parallel.threads_per_worker(16) == 4


# ---- two engine cores, offline ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    """Two engine cores behind LLM, prefix_aware routing (the default): prompts without shared prefixes spread
    as least_loaded would."""
    llm = LLM(tiny_llama, dtype="float32", data_parallel_size=2)
    yield llm
    llm.shutdown()


def test_dp2_gives_transformers_greedy_tokens_from_both_ranks(dp_llm, hf_tiny_llama):
    before = [r.num_requests_received for r in dp_llm.get_stats().per_rank]
    outputs = dp_llm.generate(ids(PROMPTS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_tiny_llama, PROMPTS, 10)
    stats = dp_llm.get_stats()
    assert [r.dp_rank for r in stats.per_rank] == [0, 1] and stats.dp_rank is None
    received = [r.num_requests_received - b for r, b in zip(stats.per_rank, before)]
    assert min(received) >= 2 and sum(received) == len(PROMPTS), received
    assert sum(r.num_requests_received for r in stats.per_rank) == stats.num_requests_received
    assert all(r.num_free_blocks == r.num_total_blocks for r in stats.per_rank)
    assert stats.num_total_blocks == sum(r.num_total_blocks for r in stats.per_rank)


def test_dp2_runs_one_named_core_process_per_rank_and_a_coordinator(dp_llm):
    names = sorted(p.name() for p in psutil.Process().children())
    assert [n for n in names if n != "python"] == ["DPCoordinator", "EngineCore_DP0", "EngineCore_DP1"], names


def test_prefix_aware_routes_a_shared_prefix_to_the_rank_holding_it(dp_llm):
    def received():
        return [(r.num_requests_received, r.prefix_cache_hits) for r in dp_llm.get_stats().per_rank]

    shared = random_prompts(1, (160, 160), seed=5)[0]
    start = received()
    dp_llm.generate(ids([shared + [7]]), GREEDY, use_tqdm=False)
    holder = next(rank for rank, (now, then) in enumerate(zip(received(), start)) if now[0] == then[0] + 1)
    time.sleep(0.5)  # the holder's prefix summary reaches the front end through the coordinator
    dp_llm.generate(ids([shared + [100 + i] * 4 for i in range(3)]), GREEDY, use_tqdm=False)
    after = received()
    assert after[holder][0] - start[holder][0] == 4, (start, after)
    assert after[holder][1] - start[holder][1] >= 3 * 144  # nine blocks of each follower came from the cache
    assert after[1 - holder][0] == start[1 - holder][0]
    # a saturating burst with the same prefix still spreads over both ranks
    dp_llm.generate(ids([shared + [300 + i] * 4 for i in range(12)]), GREEDY, use_tqdm=False)
    assert received()[1 - holder][0] - start[1 - holder][0] >= 3, received()


def test_aborts_free_blocks_on_their_rank_and_a_rank_given_up_leaves_the_other_serving(tiny_llama):
    """AsyncLLM over two cores: cancelled requests free their blocks on both ranks. With restarts off
    (``max_restarts=0``), killing rank 1's core moves its requests to rank 0, where every one finishes; the
    rank stays down and rank 0 serves alone; killing rank 0 too ends the engine (EngineDeadError) and no process
    is left. (Restarts and token-exact migration: test_failover.)"""

    async def run():
        engine = AsyncLLM(
            VllmConfig.load(
                model=tiny_llama,
                dtype="float32",
                data_parallel_size=2,
                data_parallel_routing="least_loaded",
                max_restarts=0,
            )
        )
        procs = [psutil.Process(pid) for pid in engine.engine_core.engines.pids]

        async def consume(index, prefix, max_tokens=2000):
            count = 0
            async for output in engine.generate(
                {"prompt_token_ids": PROMPTS[index]},
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                f"{prefix}-{index}",
            ):
                count = len(output.outputs[0].token_ids)
            return count

        async def every_rank_busy():  # poll, not sleep: a fast CPU finishes a rank's requests within a second
            deadline = time.monotonic() + 30
            while True:
                stats = await engine.get_stats()
                if all(r.num_running_reqs > 0 for r in stats.per_rank) or time.monotonic() > deadline:
                    return stats
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(consume(i, "abort")) for i in range(4)]
        busy = await every_rank_busy()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.monotonic() + 10
        while True:
            drained = await engine.get_stats()
            if (
                drained.num_running_reqs == 0
                and drained.num_free_blocks == drained.num_total_blocks
                or time.monotonic() > deadline
            ):
                break
            await asyncio.sleep(0.1)

        tasks = [asyncio.create_task(consume(i, "kill", 300)) for i in range(4)]
        killed_while_busy = await every_rank_busy()
        os.kill(engine.engine_core.engines.procs[1].pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=120)
        alone = await engine.get_stats()
        report = engine.health()
        os.kill(engine.engine_core.engines.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="DP rank 0"):
            while time.monotonic() - start < 10:
                async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
                    pass
                await asyncio.sleep(0.05)
        elapsed = time.monotonic() - start
        engine.shutdown()
        return busy, drained, killed_while_busy, results, alone, report, elapsed, procs

    busy, drained, killed_while_busy, results, alone, report, elapsed, procs = asyncio.run(run())
    assert all(r.num_running_reqs > 0 for r in busy.per_rank), busy
    assert all(r.num_running_reqs > 0 for r in killed_while_busy.per_rank), killed_while_busy
    assert all(r.num_free_blocks == r.num_total_blocks and r.num_running_reqs == 0 for r in drained.per_rank), drained
    assert results == [300] * 4, results  # rank 1's requests finished on rank 0
    assert [r.dp_rank for r in alone.per_rank] == [0] and alone.num_free_blocks == alone.num_total_blocks
    assert report["status"] == "degraded" and report["dp_ranks_alive"] == 1 and report["requests_migrated"] >= 1
    assert report["ranks"][1]["state"] == "given_up" and "SIGKILL" in report["ranks"][1]["reason"]
    assert elapsed < 10
    assert wait_until(lambda: alive(procs) == [], 10), alive(procs)


# ---- served: two engine cores behind two API servers ---------------------------------------------------
def served_metrics(srv) -> tuple[str, dict]:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    api = next(
        line.split('api_server="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("engine_api_server_info{")
    )
    received = {}
    for line in text.splitlines():
        if line.startswith("engine_num_requests_received{"):
            rank = line.split('dp_rank="')[1].split('"')[0]
            received[rank] = float(line.rsplit(" ", 1)[1])
    return api, received


def health_report(srv) -> dict:
    return httpx.get(srv.url + "/health?verbose=1", timeout=30).json()


def test_served_dp2_behind_two_api_servers_then_a_rank_dies_and_comes_back(tiny_llama, dp_llm, hf_tiny_llama):
    """`engine serve --data-parallel-size 2 --api-server-count 2`: transformers' greedy tokens (as the offline DP
    run, checked against transformers), both API processes answer on the one port, both ranks serve; then one
    rank's core is killed: /health stays 200 and every request is served (by the other rank) while the launcher
    restarts it; each API server takes the new core back (both ranks up again), and no process outlives the
    server."""
    reference = dp_llm.generate(ids(PROMPTS), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in reference] == hf_greedy(hf_tiny_llama, PROMPTS, 10)
    srv = Server(
        "--model",
        tiny_llama,
        "--dtype",
        "float32",
        "--data-parallel-size",
        "2",
        "--api-server-count",
        "2",
        "--data-parallel-routing",
        "least_loaded",
    )
    try:
        procs = srv.descendants()
        names = {p.name(): p for p in psutil.Process(srv.proc.pid).children()}
        assert {"APIServer_0", "APIServer_1", "EngineCore_DP0", "EngineCore_DP1", "DPCoordinator"} <= set(names)

        def served_texts() -> list[str]:
            texts = []
            for prompt in PROMPTS:
                with httpx.Client(timeout=60) as client:  # a new connection each: the API servers share the port
                    response = client.post(
                        srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0}
                    )
                    assert response.status_code == 200, response.text
                    texts.append(response.json()["choices"][0]["text"])
            return texts

        assert served_texts() == [o.outputs[0].text for o in reference]
        answered, received = set(), {}
        for _ in range(60):
            api, received = served_metrics(srv)
            answered.add(api)
            if answered == {"0", "1"}:
                break
        assert answered == {"0", "1"}, answered  # both API-server processes answer on the one port
        assert set(received) == {"0", "1"} and min(received.values()) >= 2, received  # both ranks served
        status = httpx.get(srv.url + "/v1/engine/status", timeout=60).json()  # the console's view of each rank
        assert [r["dp_rank"] for r in status["dp_ranks"]] == [0, 1], status["dp_ranks"]
        assert min(r["requests_received"] for r in status["dp_ranks"]) >= 2
        assert {"attention", "executor", "kv_cache_coordinator"} <= {p["kind"] for p in status["plugins"]}

        names["EngineCore_DP1"].kill()
        for _ in range(8):  # while rank 1 is down and restarting: healthy, and every request is answered
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        assert served_texts() == [o.outputs[0].text for o in reference]

        def both_ranks_back_on_every_api_server() -> bool:
            reports = [health_report(srv) for _ in range(8)]
            return all(r["dp_ranks_alive"] == 2 and r["engine_core_deaths"] == 1 for r in reports)

        assert wait_until(both_ranks_back_on_every_api_server, 120, 0.5), health_report(srv)
        restarted = {p.name(): p for p in psutil.Process(srv.proc.pid).children()}["EngineCore_DP1"]
        assert restarted.pid != names["EngineCore_DP1"].pid
        assert served_texts() == [o.outputs[0].text for o in reference]
        assert "restarting it in 1 s" in srv.output()
        # the front-end counters are the server's, whichever API server answers (multiprocess metrics)
        scraped = {}
        for _ in range(40):
            text = httpx.get(srv.url + "/metrics", timeout=30).text
            api = text.split('engine_api_server_info{api_server="')[1].split('"')[0]
            scraped[api] = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("engine_request_success_total{")
            ]
            if set(scraped) == {"0", "1"}:
                break
        assert scraped == {"0": [24.0], "1": [24.0]}, scraped
        procs += [restarted]
    finally:
        srv.stop()
    assert wait_until(lambda: alive(procs) == [], 15), alive(procs)


def test_a_front_end_reusing_another_ones_request_id_cannot_take_its_outputs(tiny_llama, tmp_path):
    """Two front ends on one engine core (as two API servers): the second sending a running request's id gets an
    error for it alone; the first still receives every token of its request and the finish."""
    from engine.frontend.core_client import RemoteEngines, SyncMPClient
    from engine.messages import EngineCoreRequest
    from engine.processes.core_launcher import CoreEngineProcManager, make_addresses

    config = VllmConfig.load(model=tiny_llama, dtype="float32")
    ipc_dir = str(tmp_path / "engine-ipc-test")
    os.makedirs(ipc_dir)
    addresses = make_addresses(ipc_dir, 2, 1)
    manager = CoreEngineProcManager(config, addresses, ipc_dir)
    first = SyncMPClient(config, RemoteEngines(addresses, 0, manager.pids))
    second = SyncMPClient(config, RemoteEngines(addresses, 1, manager.pids))
    try:
        # long enough that it still runs when the second front end's copy arrives, on a slow or busy machine too
        # (at 40 tokens it had sometimes finished, and the copy was then served instead of refused)
        params = SamplingParams(max_tokens=400, ignore_eos=True)

        def next_outputs(client):  # a misrouted output would leave this client waiting: fail instead of hanging
            return client.outputs.get(timeout=30).outputs

        # the running request belongs to front end 1 (not the default 0); once it produced a token, front end 0
        # sends the same id (the two sockets are not ordered with each other, so wait for that token first)
        second.add_request(EngineCoreRequest("shared-id", PROMPTS[0], params, None, 0.0))
        outputs = next_outputs(second)
        tokens, finish = sum(len(o.new_token_ids) for o in outputs), outputs[-1].finish_reason
        first.add_request(EngineCoreRequest("shared-id", PROMPTS[1], params, None, 0.0))
        refused = next_outputs(first)[0]
        assert refused.finish_reason == "error" and "already running" in refused.error
        while finish is None:
            for output in next_outputs(second):
                tokens += len(output.new_token_ids)
                finish = output.finish_reason
        assert (tokens, finish) == (400, "length")
    finally:
        first.shutdown()
        second.shutdown()
        manager.shutdown()
