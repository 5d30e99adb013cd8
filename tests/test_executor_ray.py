"""The Ray executor plugin (plugins/executor_ray) on a local Ray cluster of two simulated one-CPU nodes."""
from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="the ray executor's tests need ray (scripts/install.sh installs it)")

from engine import LLM, EngineDeadError, SamplingParams  # noqa: E402
from engine.config import VllmConfig  # noqa: E402
from engine.interfaces.base import SelectionContext  # noqa: E402
from engine.plugins import get_plugin_manager  # noqa: E402
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


@pytest.fixture(scope="module")
def ray_llm(tiny_llama, two_node_cluster):
    llm = LLM(tiny_llama, dtype="float32", executor="ray", tensor_parallel_size=2,
              ray_address=two_node_cluster.address)
    yield llm
    llm.shutdown()


def executor_of(llm):
    return llm.llm_engine.engine_core.engine_core.executor


def test_the_ray_executor_says_why_it_cannot_run_without_ray(monkeypatch):
    import importlib.util

    from engine_executor_ray.plugin import RayExecutor

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    assert RayExecutor.unavailable_reasons(SelectionContext(VllmConfig.load())) == [
        "ray is not installed: pip install engine-executor-ray (it depends on ray)"]
    row = next(r for r in get_plugin_manager().table(SelectionContext(VllmConfig.load()))
               if r["kind"] == "executor" and r["name"] == "ray")
    assert row["source"] == "engine-executor-ray 0.1.0"


def test_tp2_over_ray_places_one_rank_per_node_and_gives_transformers_greedy_tokens(ray_llm, hf_tiny_llama):
    executor = executor_of(ray_llm)
    assert type(executor).__name__ == "RayExecutor"
    assert len(set(executor.worker_node_ids)) == 2  # two one-CPU nodes: one rank on each
    outputs = ray_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8),
                               use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_tiny_llama, PROMPTS, 8)
    executor.check_health()


def test_killing_a_worker_actor_fails_pending_requests_with_engine_dead(ray_llm):
    engine = ray_llm.llm_engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=400, ignore_eos=True))
    engine.step()
    ray.kill(executor_of(ray_llm).workers[1])
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(EngineDeadError):
        executor_of(ray_llm).check_health()
