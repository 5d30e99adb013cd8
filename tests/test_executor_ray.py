"""The Ray executor plugin (plugins/executor_ray) and Ray-placed data-parallel engine cores, on a local Ray
cluster of two simulated one-CPU nodes: TP=2 and PP=2 over the ray executor, DP=2 over the ray DP backend."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="the ray executor's tests need ray (scripts/install.sh installs it)")

from engine import LLM, EngineDeadError, SamplingParams  # noqa: E402
from engine.config import VllmConfig  # noqa: E402
from engine.interfaces.base import SelectionContext  # noqa: E402
from engine.plugins import get_plugin_manager  # noqa: E402
from engine.testing import inspect  # noqa: E402
from tests.helpers import hf_greedy, random_prompts  # noqa: E402

PROMPTS = random_prompts(4, (5, 40), seed=61)


@pytest.fixture(scope="module")
def two_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


RAY_LAYOUTS = {
    "tp2": dict(executor="ray", tensor_parallel_size=2),
    "pp2": dict(executor="ray", pipeline_parallel_size=2),
    "dp2": dict(data_parallel_size=2, data_parallel_backend="ray"),  # each core's own (uniproc) executor
}


@pytest.fixture(scope="module", params=list(RAY_LAYOUTS))
def ray_llm(request, tiny_llama, two_node_cluster):
    """Two ranks over the two nodes, one layout after the other (each shut down frees the CPUs)."""
    llm = LLM(tiny_llama, dtype="float32", ray_address=two_node_cluster.address, **RAY_LAYOUTS[request.param])
    yield llm
    llm.shutdown()


def executor_of(llm):
    return inspect(llm).executor


def is_data_parallel(llm) -> bool:
    return llm.llm_engine.vllm_config.parallel.data_parallel_size > 1


def rank_node_ids(llm) -> list[str]:
    """The node of each Ray actor: the executor's workers, or the DP backend's engine cores."""
    return inspect(llm).client.engines.node_ids if is_data_parallel(llm) else executor_of(llm).worker_node_ids


def check_health(llm) -> None:
    if is_data_parallel(llm):
        assert inspect(llm).client.call_utility("check_health")
    else:
        executor_of(llm).check_health()


def test_the_ray_executor_says_why_it_cannot_run_without_ray(monkeypatch):
    import importlib.metadata
    import importlib.util

    from engine_executor_ray.plugin import RayExecutor

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert RayExecutor.unavailable_reasons(SelectionContext(VllmConfig.load())) == [
        "ray is not installed: pip install engine-executor-ray (it depends on ray)"
    ]
    row = next(
        r
        for r in get_plugin_manager().table(SelectionContext(VllmConfig.load()))
        if r["kind"] == "executor" and r["name"] == "ray"
    )
    # the table names the distribution the plugin came from, at its installed version
    assert row["source"] == f"engine-executor-ray {importlib.metadata.version('engine-executor-ray')}"


def test_the_ray_dp_backend_runs_one_api_server():
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="parallel.data_parallel_backend=ray runs one API server"):
        VllmConfig.load(data_parallel_size=2, data_parallel_backend="ray", api_server_count=2)


def test_two_ranks_over_ray_are_placed_one_per_node_and_give_transformers_greedy_tokens(ray_llm, hf_tiny_llama):
    if not is_data_parallel(ray_llm):
        assert type(executor_of(ray_llm)).__name__ == "RayExecutor"
    assert len(set(rank_node_ids(ray_llm))) == 2  # two one-CPU nodes: one rank (TP rank, stage, DP rank) on each
    outputs = ray_llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_tiny_llama, PROMPTS, 8)
    check_health(ray_llm)
    if is_data_parallel(ray_llm):  # both engine cores served requests
        assert [rank.num_requests_received > 0 for rank in ray_llm.get_stats().per_rank] == [True, True]


def test_killing_a_worker_actor_fails_pending_requests_with_engine_dead(ray_llm):
    engine = ray_llm.llm_engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=400, ignore_eos=True))
    engine.step()
    actors = engine.engine_core.engines.actors if is_data_parallel(ray_llm) else executor_of(ray_llm).workers
    ray.kill(actors[1])
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(EngineDeadError):
        check_health(ray_llm)
