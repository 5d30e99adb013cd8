"""RayExecutor: one Ray actor per rank (TP x PP), on one machine or across a Ray cluster's nodes.

The actors are placed by a placement group (one bundle per rank, packed: ranks share a node while it has
room, so a cluster of one-CPU nodes gets one rank per node). Ranks are numbered after placement, those on
the driver's node first, and rank 0's node hosts the torch.distributed rendezvous (gloo on CPUs, NCCL on
GPUs). Each step's call is put in Ray's object store once and every actor runs it; any actor whose call
fails or dies (a killed actor, a lost node) fails the step with EngineDeadError and the other actors are
killed (they may be waiting in a collective for the dead one), so nothing hangs. Calls do not wait for each
other (each actor runs them in order), so the engine core keeps one step per pipeline stage in flight.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from engine import hookimpl
from engine.distributed.ray_placement import RayPlacement
from engine.errors import EngineDeadError
from engine.interfaces.executor import Executor

ENGINE_CONTRACT_VERSION = "1.0"
logger = logging.getLogger(__name__)
_POLL_S = 0.1
_STARTUP_TIMEOUT_S = 600
_HEALTH_TIMEOUT_S = 10


class RayWorkerWrapper:
    """What runs inside each actor: the rank's Worker, built once the ranks are numbered."""

    def __init__(self):
        self.worker = None

    def placement(self) -> tuple[str, str]:
        """(node id, node IP) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def init_worker(self, vllm_config, plugin_choices: dict, rank: int, init_method: str) -> None:
        import ray

        from engine.worker.worker import Worker

        gpu_ids = ray.get_gpu_ids()  # Ray shows each actor its own GPU(s) only: device index 0
        self.worker = Worker(
            vllm_config,
            plugin_choices,
            rank=rank,
            distributed_init_method=init_method,
            device_index=0 if gpu_ids else None,
        )
        self.worker.init_device()
        self.worker.load_model()

    def execute(self, call: tuple) -> Any:
        method, args, kwargs = call
        return getattr(self.worker, method)(*args, **kwargs)

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _actor_class(num_cpus: float, num_gpus: float):
    """The wrapper as a Ray actor class; ``ping`` has its own thread, so health checks do not queue behind a step."""
    import ray

    cls = type(
        "RayWorkerWrapper", (RayWorkerWrapper,), {"ping": ray.method(concurrency_group="health")(RayWorkerWrapper.ping)}
    )
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, concurrency_groups={"health": 1})(cls)  # type: ignore[call-overload]  # ray's stubs lack concurrency_groups


class RayExecutor(Executor):
    """Workers as Ray actors in a placement group; ``parallel.ray_address`` joins a running cluster."""

    name = "ray"
    priority = 0  # never chosen by ``auto``: a cluster is a deliberate choice

    @classmethod
    def unavailable_reasons(cls, ctx) -> list[str]:
        if importlib.util.find_spec("ray") is None:
            return ["ray is not installed: pip install engine-executor-ray (it depends on ray)"]
        return []

    def _init_executor(self) -> None:
        parallel, device = self.vllm_config.parallel, self.vllm_config.device
        world = parallel.world_size
        self.dead: Optional[str] = None
        self.waiter = ThreadPoolExecutor(1, thread_name_prefix="ray-answers")  # resolves calls in order
        self.workers: list[Any] = []
        self.placement = RayPlacement(parallel.ray_address, "parallel.executor=ray")
        ray = self.placement.ray
        try:
            use_gpu = self.placement.wants_gpus(device.device, world)
            cpus = float(device.num_threads or 1)
            bundle = {"CPU": cpus, **({"GPU": 1.0} if use_gpu else {})}
            self.placement.place(bundle, world, "workers")
            actor_cls = _actor_class(cpus, 1.0 if use_gpu else 0.0)
            actors = [actor_cls.options(scheduling_strategy=self.placement.strategy(i)).remote() for i in range(world)]
            placements = ray.get([actor.placement.remote() for actor in actors], timeout=_STARTUP_TIMEOUT_S)
            driver_node = ray.get_runtime_context().get_node_id()
            order = sorted(range(world), key=lambda i: (placements[i][0] != driver_node, placements[i][0]))
            self.workers = [actors[i] for i in order]
            self.worker_node_ids = [placements[i][0] for i in order]
            port = ray.get(self.workers[0].free_port.remote())
            init_method = f"tcp://{placements[order[0]][1]}:{port}"
            self._gather(
                [
                    worker.init_worker.remote(self.vllm_config, self.plugin_choices, rank, init_method)
                    for rank, worker in enumerate(self.workers)
                ],
                _STARTUP_TIMEOUT_S,
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d workers on %d node(s)", world, len(set(self.worker_node_ids)))

    def _gather(self, refs: list, timeout: Optional[float] = None) -> list[Any]:
        """Every rank's result; the first failure or death fails at once (its peers may be stuck waiting)."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except Exception as exc:
                    raise self._fail(f"worker rank {rank} failed: {type(exc).__name__}: {_first_line(exc)}") from None
            if deadline is not None and time.monotonic() > deadline:
                raise self._fail(f"workers did not answer within {timeout}s")
        return [results[rank] for rank in range(len(refs))]

    def _fail(self, reason: str) -> EngineDeadError:
        self.dead = self.dead or reason
        logger.error("ray executor: %s", reason)
        self._kill_workers()
        return EngineDeadError(reason)

    def collective_rpc_async(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> Future:
        import ray

        if self.dead:
            raise EngineDeadError(self.dead)
        call = ray.put((method, args, kwargs or {}))  # serialized once, read by every actor
        return self.waiter.submit(self._gather, [worker.execute.remote(call) for worker in self.workers])

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        return self.collective_rpc_async(method, args, kwargs).result()

    def check_health(self) -> None:
        import ray

        if self.dead:
            raise EngineDeadError(self.dead)
        refs = [worker.ping.remote() for worker in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_HEALTH_TIMEOUT_S)
        if len(ready) < len(refs):
            raise self._fail(f"workers did not answer a health check within {_HEALTH_TIMEOUT_S}s")
        self._gather(refs)

    def _kill_workers(self) -> None:
        import ray

        for worker in self.workers:
            try:
                ray.kill(worker)
            except Exception as exc:  # already gone with its node
                logger.debug("worker actor not killed: %s", exc)

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        if self.workers and not self.dead:
            try:
                ray.get([worker.shutdown.remote() for worker in self.workers], timeout=10)
            except Exception:
                pass
        self._kill_workers()
        self.workers = []
        self.waiter.shutdown(wait=False, cancel_futures=True)  # calls in flight fail: their actors are gone
        self.placement.release()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


@hookimpl
def engine_executors():
    return [RayExecutor]
