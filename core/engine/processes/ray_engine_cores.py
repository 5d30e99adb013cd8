"""Data-parallel engine cores as Ray actors (``parallel.data_parallel_backend=ray``), vLLM's Ray DP backend.

Each DP rank's ``EngineCoreProc`` runs in an actor placed by a placement group (one bundle per rank, with the
CPUs, or GPUs, of its TP x PP workers), so ranks land on the cluster's nodes; each core starts its own
executor there. The front end and the DP coordinator stay on this machine and listen on TCP addresses of its
node IP, which the cores connect to. An actor that dies (or whose node is lost) ends its ``run`` call, which
``first_failure`` reports; Ray ends the actors with the process that created them.
"""

from __future__ import annotations

import logging
import socket
from multiprocessing.process import BaseProcess
from typing import Any, Optional

from engine.config import VllmConfig
from engine.data_parallel.coordinator import start_dp_coordinator
from engine.distributed.ray_placement import RayPlacement, require_ray
from engine.lifetime import describe_exit, stop_processes
from engine.messages import EngineZmqAddresses

logger = logging.getLogger(__name__)
_KEY = "parallel.data_parallel_backend=ray"


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def make_tcp_addresses(num_front_ends: int, data_parallel_size: int) -> EngineZmqAddresses:
    """TCP addresses on this node's IP (reachable from the cluster's other nodes), on free ports."""
    host = require_ray(_KEY).util.get_node_ip_address()
    address = lambda: f"tcp://{host}:{_free_port(host)}"  # noqa: E731
    with_coordinator = data_parallel_size > 1
    return EngineZmqAddresses(
        inputs=[address() for _ in range(num_front_ends)],
        outputs=[address() for _ in range(num_front_ends)],
        coordinator_input=address() if with_coordinator else None,
        coordinator_output=address() if with_coordinator else None,
    )


class EngineCoreActor:
    """What runs in each actor: one DP rank's engine core, until it is told to stop or the actor is killed."""

    def placement(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, vllm_config: VllmConfig, addresses: EngineZmqAddresses, log_level: int) -> None:
        from engine.engine_core.core_proc import EngineCoreProc
        from engine.lifetime import set_process_name

        rank = vllm_config.parallel.data_parallel_rank
        set_process_name(f"EngineCore_DP{rank}")
        logging.basicConfig(
            level=log_level, format=f"%(levelname)s %(asctime)s dp{rank} %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
        logging.getLogger("engine").setLevel(log_level)
        core = EngineCoreProc(vllm_config, addresses)
        try:
            core.run_busy_loop()
        finally:
            core.shutdown()
            core.ctx.destroy(linger=1000)


class RayEngineCoreManager:
    """The engine core of every DP rank as a Ray actor, and (with more than one) the DP coordinator as a local
    process: started, watched, stopped (the interface of ``CoreEngineProcManager``)."""

    def __init__(self, vllm_config: VllmConfig, addresses: EngineZmqAddresses):
        parallel, device = vllm_config.parallel, vllm_config.device
        size, world = parallel.data_parallel_size, parallel.world_size
        self.procs: list[BaseProcess] = []  # no engine-core process of this machine
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        self.coordinator: Optional[BaseProcess] = None
        self.placement = RayPlacement(parallel.ray_address, _KEY)
        ray = self.placement.ray
        try:
            self.coordinator = start_dp_coordinator(size, addresses)
            # one bundle per DP rank: its workers' CPUs (device.num_threads each, default 1) and GPUs
            use_gpu = self.placement.wants_gpus(device.device, size * world)
            bundle = {"CPU": float(world * (device.num_threads or 1)), **({"GPU": float(world)} if use_gpu else {})}
            self.placement.place(bundle, size, "engine cores")
            actor_cls = ray.remote(EngineCoreActor)
            log_level = logging.getLogger("engine").getEffectiveLevel()
            for rank in range(size):
                actor = actor_cls.options(
                    name=None,
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0.0),
                    scheduling_strategy=self.placement.strategy(rank),
                ).remote()
                self.actors.append(actor)
            # asked before ``run``, which holds each actor for the life of its core
            self.node_ids = ray.get([actor.placement.remote() for actor in self.actors])
            for rank, actor in enumerate(self.actors):
                config = vllm_config.model_copy(deep=True)
                config.parallel.data_parallel_rank = rank
                config.device.num_threads = device.num_threads or 1  # the bundle's CPUs, not the node's
                self.runs.append(actor.run.remote(config, addresses, log_level))
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d engine core(s) as Ray actors on %d node(s)", size, len(set(self.node_ids)))

    @property
    def pids(self) -> list[int]:
        return [self.coordinator.pid] if self.coordinator is not None and self.coordinator.pid is not None else []

    def first_failure(self) -> Optional[str]:
        """Why the engine cannot serve any more (an engine-core actor's run ended, the coordinator ended), or None."""
        import ray

        if not self.runs or not ray.is_initialized():
            return "the engine cores (Ray actors) were shut down"
        ended, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in ended:
            rank = self.runs.index(ref)
            try:
                ray.get(ref)
                why = "stopped"
            except Exception as exc:
                text = str(exc).strip()
                why = f"failed: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            return f"engine core of DP rank {rank} (Ray actor) {why}"
        if self.coordinator is not None and not self.coordinator.is_alive():
            return f"DP coordinator process ended ({describe_exit(self.coordinator)})"
        return None

    def failed_ranks(self) -> dict[int, tuple[int, str]]:
        """Ray-placed cores are not restarted one by one: any ended actor ends the engine (``coordinator_failure``)."""
        return {}

    def coordinator_failure(self) -> Optional[str]:
        return self.first_failure()

    def join(self, timeout: float) -> None:
        import ray

        if self.runs and ray.is_initialized():
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)

    def shutdown(self) -> None:
        """Kill the actors (their worker processes end with them), release the placement (and Ray itself when
        this manager started it), stop the coordinator."""
        ray = self.placement.ray
        if ray.is_initialized():
            for actor in self.actors:
                try:
                    ray.kill(actor)
                except Exception as exc:  # already gone with its node
                    logger.debug("engine-core actor not killed: %s", exc)
        self.actors, self.runs = [], []
        self.placement.release()
        stop_processes([self.coordinator], grace=5)
        self.coordinator = None
