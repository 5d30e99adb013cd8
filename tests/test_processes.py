"""Processes: EngineCoreProc over ZMQ, the three clients, AsyncLLM, multiproc executor, failures."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from engine import LLM, AsyncLLM, EngineDeadError, SamplingParams
from engine.config import VllmConfig
from engine.testing import inspect
from tests.helpers import alive, assert_all_blocks_free, random_prompts, wait_for_async, wait_until

PROMPTS = random_prompts(6, (5, 60), seed=31)
PARAMS = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=1.0, seed=9, max_tokens=10)] * 3


def token_lists(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def inproc_reference(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32")
    return token_lists(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))


def descendants() -> list[psutil.Process]:
    """Live child processes, minus multiprocessing's resource tracker (one per parent, Python's own)."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(proc.cmdline()):
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_gone(timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while descendants() and time.monotonic() < deadline:
        time.sleep(0.1)
    return descendants()


def test_sync_mp_client_equals_inproc(tiny_llama, inproc_reference):
    llm = LLM(tiny_llama, dtype="float32", engine_core_process=True)
    assert type(inspect(llm).client).__name__ == "SyncMPClient"
    assert (
        token_lists(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
        == inproc_reference
    )
    assert_all_blocks_free(llm)
    llm.shutdown()
    assert wait_gone() == []


def test_async_mp_client_equals_inproc(tiny_llama, inproc_reference):
    async def run():
        config = VllmConfig.load(model=tiny_llama, dtype="float32")
        engine = AsyncLLM(config)
        # its core runs in a process of its own, and its config (and start-up log) says so
        assert engine.vllm_config.parallel.engine_core_process and not config.parallel.engine_core_process
        try:

            async def one(index):
                final = None
                async for output in engine.generate({"prompt_token_ids": PROMPTS[index]}, PARAMS[index], f"r{index}"):
                    final = output
                return final.outputs[0].token_ids

            tokens = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            stats = await engine.get_stats()
            return tokens, stats
        finally:
            engine.shutdown()

    tokens, stats = asyncio.run(run())
    assert tokens == inproc_reference
    assert stats.num_free_blocks == stats.num_total_blocks
    assert wait_gone() == []


@pytest.mark.parametrize(
    "config",
    [
        {"async_scheduling": True},
        {"async_scheduling": True, "num_gpu_blocks_override": 12, "block_size": 8, "max_model_len": 96},
        {"async_scheduling": True, "max_num_batched_tokens": 16},
        {"async_scheduling": True, "executor": "multiproc"},
    ],
    ids=["async", "async-preempt", "async-chunked", "async-multiproc"],
)
def test_async_scheduling_gives_the_same_outputs(tiny_llama, inproc_reference, config):
    llm = LLM(tiny_llama, dtype="float32", **config)
    assert (
        token_lists(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False))
        == inproc_reference
    )
    assert_all_blocks_free(llm)
    if "num_gpu_blocks_override" in config:
        assert llm.get_stats().num_preemptions > 0
    llm.shutdown()


@pytest.mark.slow  # the real SmolLM2 weights
def test_tensor_parallel_2_equals_1_on_smollm2():
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "List three colors:",
    ]
    results = {}
    for tp in (1, 2):
        # float weights: packed ones run the product each shape's measurement chose (integer dots on activations
        # rounded to int8, or the de-quantized GEMM on float ones), and TP=2's shard shapes may choose differently
        llm = LLM(
            dtype="float32", quantization="none", tensor_parallel_size=tp, kv_cache_memory="128MiB", max_model_len=1024
        )
        results[tp] = token_lists(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False))
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert results[2] == results[1]
    assert wait_gone() == []


def test_a_script_without_a_main_guard_runs_tensor_parallel_and_exits_cleanly(tiny_llama, inproc_reference, tmp_path):
    """`LLM(..., tensor_parallel_size=2)` at module level, no `if __name__ == "__main__":` — the spawned
    worker and engine-core processes do not re-run the script, and shutting down leaks nothing."""
    import json

    script = tmp_path / "user_script.py"
    params = [{"temperature": p.temperature, "seed": p.seed, "max_tokens": p.max_tokens} for p in PARAMS]
    script.write_text(f"""
import json
from engine import LLM, SamplingParams
print("script body runs", flush=True)
llm = LLM({tiny_llama!r}, dtype="float32", tensor_parallel_size=2, engine_core_process=True)
outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}], [SamplingParams(**p) for p in {params!r}])
print(json.dumps([o.outputs[0].token_ids for o in outs]))
llm.shutdown()
""")
    result = run_script(script, timeout=300)
    lines = result.stdout.strip().splitlines()
    assert lines.count("script body runs") == 1  # not re-run by the engine core or either worker
    tokens = json.loads(lines[-1])
    assert tokens[0::2] == inproc_reference[0::2]  # the greedy requests: tensor parallel gives the same tokens
    assert "leaked semaphore" not in result.stderr and "bootstrapping phase" not in result.stderr, result.stderr


def test_killed_worker_raises_engine_dead_and_leaves_no_process(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2)
    workers = inspect(llm).executor.workers
    assert len(workers) == 2 and len(descendants()) >= 2
    engine = llm.llm_engine
    for prompt in PROMPTS:
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(workers[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    assert wait_gone() == []


def test_killed_worker_under_async_llm_fails_every_request(tiny_llama):
    async def run():
        # fail-stop (no restart): the engine is dead once its one core is (restarts: test_failover)
        engine = AsyncLLM(VllmConfig.load(model=tiny_llama, dtype="float32", tensor_parallel_size=2, max_restarts=0))
        core = psutil.Process(engine.engine_core.proc.pid)
        workers = core.children()
        assert len(workers) >= 2

        received = [0] * 4

        async def consume(index):
            async for _ in engine.generate(
                {"prompt_token_ids": PROMPTS[index]}, SamplingParams(max_tokens=500, ignore_eos=True), f"k{index}"
            ):
                received[index] += 1
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        await wait_for_async(lambda: all(received), 60)  # every request under way, none near its 500 tokens
        workers[0].kill()
        start = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
                pass
        engine.shutdown()
        return results, elapsed

    results, elapsed = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 10
    assert wait_gone() == []


def test_killed_engine_core_process_raises_engine_dead(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", engine_core_process=True, max_restarts=0)
    engine = llm.llm_engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=500, ignore_eos=True))
    engine.step()
    os.kill(engine.engine_core.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    llm.shutdown()
    assert wait_gone() == []


def test_100_concurrent_requests_with_a_third_cancelled(tiny_llama):
    async def run():
        engine = AsyncLLM(VllmConfig.load(model=tiny_llama, dtype="float32", max_num_seqs=64))
        prompts = random_prompts(100, (5, 40), seed=32)

        async def one(index):
            count = 0
            async for output in engine.generate(  # noqa: B007 (the last one is read below)
                {"prompt_token_ids": prompts[index]},
                SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=index),
                f"c{index}",
            ):
                count += 1
            return output

        tasks = [asyncio.create_task(one(i)) for i in range(100)]
        await asyncio.sleep(0.5)
        while not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        for index in range(0, 100, 3):
            tasks[index].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.2)
        stats = await engine.get_stats()
        engine.shutdown()
        return results, stats

    results, stats = asyncio.run(run())
    kept = [r for i, r in enumerate(results) if i % 3]
    assert all(not isinstance(r, BaseException) and r.finished and len(r.outputs[0].token_ids) == 24 for r in kept)
    cancelled = [r for i, r in enumerate(results) if i % 3 == 0]
    assert all(isinstance(r, (asyncio.CancelledError)) or r.finished for r in cancelled)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running_reqs == 0
    assert wait_gone() == []


@pytest.mark.parametrize(
    "config",
    ["data_parallel_size=2", "engine_core_process=True", "tensor_parallel_size=2"],
    ids=["dp2", "engine-core-process", "tp2"],  # PP=2 runs the same multiproc executor as TP=2
)
def test_a_script_that_simply_ends_exits_and_leaves_no_process(tiny_llama, tmp_path, config):
    """Most scripts never call shutdown: they generate, print and end. With data parallelism such a script used to
    print its results and hang for ever (multiprocessing's exit handler joined the engine cores, which waited for
    their living parent). It must exit, and every process the engine started must end with it."""

    import psutil

    script = tmp_path / "simple_script.py"
    script.write_text(f"""
import psutil
from engine import LLM, SamplingParams
llm = LLM({tiny_llama!r}, dtype="float32", {config})
out = llm.generate([{{"prompt_token_ids": [5, 6, 7, 8]}}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("children", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
print("tokens", out[0].outputs[0].token_ids, flush=True)
""")
    result = run_script(script, timeout=180)
    assert "tokens" in result.stdout
    line = next(line for line in result.stdout.splitlines() if line.startswith("children"))
    children = []
    for pid in line.split()[1:]:
        try:
            children.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            pass
    assert wait_until(lambda: not alive(children), timeout=30), alive(children)


def test_ctrl_c_in_a_terminal_stops_engine_serve_in_order(tiny_llama):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the engine core and the tensor-parallel
    workers get it as well as the API server. Found: the engine core died of a KeyboardInterrupt in its loop, the
    server took that for a crash ("engine core failed: KeyboardInterrupt: : restarting it in 1 s"), and the server
    ended on a KeyboardInterrupt traceback with exit status -2. Now the processes the engine started leave the
    interrupt to their parent, which stops them in order, and the server ends with status 0."""
    from tests.helpers import tiny_server

    server = tiny_server(tiny_llama, "--tensor-parallel-size", "2", process_group=True)
    try:
        reply = httpx.post(
            server.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        children = server.descendants()
        assert len(children) >= 3, children  # the engine core and its two workers
        os.killpg(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(60) == 0, server.output()
        assert wait_until(lambda: not alive(children), timeout=30), alive(children)
        output = server.output()
        assert "Traceback" not in output and "ERROR" not in output and "restarting" not in output, output
    finally:
        server.stop()


def test_an_engine_process_with_triton_loaded_ends_without_leak_reports(tmp_path):
    """nanobind (triton's bindings) reports each of its objects still alive when the interpreter ends. Found: with
    every object frozen at exit, `engine bench kernels` ended on "nanobind: leaked 4 instances!" and a list of 64
    types. Where a nanobind extension is loaded, the last exit hook leaves the objects to the collector."""
    pytest.importorskip("triton")
    script = tmp_path / "with_triton.py"
    script.write_text("""
from engine.lifetime import end_engine_process_quickly, nanobind_extension_loaded

end_engine_process_quickly()
assert nanobind_extension_loaded() is None
import triton.language  # noqa: F401

print("nanobind module", nanobind_extension_loaded(), flush=True)
""")
    result = run_script(script, timeout=120)
    assert "nanobind module triton" in result.stdout, result.stdout
    assert "leaked" not in result.stderr, result.stderr[-2000:]


def run_script(script, timeout: float):
    """Run a user script in a fresh interpreter (this test run's import path), from its folder; it must exit 0."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=script.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    return result


def test_a_process_that_lives_for_one_engine_ends_without_the_collectors_passes(tmp_path):
    """An engine core, worker, API server or ``engine`` command keeps its start-up freeze through shutdown and
    freezes every object at exit, after the other exit hooks, so the interpreter's finalization has nothing
    to collect (it walked every object of torch and transformers: most of an engine core's stop)."""
    script = tmp_path / "ends.py"
    script.write_text("""
import atexit
import gc

def report():  # registered first: runs after every other exit hook
    print("at exit: tracked", len(gc.get_objects()), "frozen", gc.get_freeze_count(), flush=True)

atexit.register(report)
from engine.lifetime import end_engine_process_quickly, freeze_gc_heap, release_gc_heap

end_engine_process_quickly()
freeze_gc_heap()
frozen = gc.get_freeze_count()
release_gc_heap()
print("freeze kept through shutdown", gc.get_freeze_count() == frozen > 0, flush=True)
atexit.register(lambda: print("a shutdown hook runs first", flush=True))
garbage = [[n] for n in range(5000)]
""")
    lines = run_script(script, timeout=60).stdout.splitlines()
    assert lines[:2] == ["freeze kept through shutdown True", "a shutdown hook runs first"], lines
    words = lines[2].split()
    assert words[:3] == ["at", "exit:", "tracked"] and int(words[3]) < 100 and int(words[5]) > 5000, lines
