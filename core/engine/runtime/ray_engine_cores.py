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
import time
from typing import Optional

from engine.config import ConfigError, VllmConfig
from engine.runtime.messages import EngineZmqAddresses

logger = logging.getLogger(__name__)
_PLACEMENT_TIMEOUT_S = 60


def require_ray(key: str = "parallel.data_parallel_backend=ray"):
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{key} needs ray: pip install engine-executor-ray (it depends on ray), or set "
                          "parallel.data_parallel_backend=mp") from None
    return ray


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def make_tcp_addresses(num_front_ends: int, data_parallel_size: int) -> EngineZmqAddresses:
    """TCP addresses on this node's IP (reachable from the cluster's other nodes), on free ports."""
    host = require_ray().util.get_node_ip_address()
    address = lambda: f"tcp://{host}:{_free_port(host)}"  # noqa: E731
    with_coordinator = data_parallel_size > 1
    return EngineZmqAddresses(
        inputs=[address() for _ in range(num_front_ends)], outputs=[address() for _ in range(num_front_ends)],
        coordinator_input=address() if with_coordinator else None,
        coordinator_output=address() if with_coordinator else None)


class EngineCoreActor:
    """What runs in each actor: one DP rank's engine core, until it is told to stop or the actor is killed."""

    def placement(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, vllm_config: VllmConfig, addresses: EngineZmqAddresses, log_level: int) -> None:
        from engine.runtime.core_proc import EngineCoreProc
        from engine.runtime.lifetime import set_process_name

        rank = vllm_config.parallel.data_parallel_rank
        set_process_name(f"EngineCore_DP{rank}")
        logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s dp{rank} %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
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
        ray = require_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from engine.runtime.core_launcher import start_dp_coordinator

        parallel, device = vllm_config.parallel, vllm_config.device
        size, world = parallel.data_parallel_size, parallel.world_size
        self.procs: list = []  # no engine-core process of this machine
        self.actors: list = []
        self.runs: list = []
        self.placement_group = None
        self.coordinator = None
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=parallel.ray_address, include_dashboard=False, log_to_driver=True,
                     configure_logging=False)
        try:
            self.coordinator = start_dp_coordinator(size, addresses)
            use_gpu = device.device == "cuda" or (
                device.device == "auto" and ray.cluster_resources().get("GPU", 0) >= size * world)
            # one bundle per DP rank: its workers' CPUs (device.num_threads each, default 1) and GPUs
            bundle = {"CPU": float(world * (device.num_threads or 1)), **({"GPU": float(world)} if use_gpu else {})}
            self.placement_group = placement_group([bundle] * size, strategy="PACK")
            if not ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)[0]:
                raise ConfigError(f"parallel.data_parallel_size={size}: the Ray cluster cannot place {size} engine "
                                  f"cores of {bundle} within {_PLACEMENT_TIMEOUT_S}s (resources: "
                                  f"{ray.cluster_resources()})")
            actor_cls = ray.remote(EngineCoreActor)
            log_level = logging.getLogger("engine").getEffectiveLevel()
            for rank in range(size):
                actor = actor_cls.options(
                    name=None, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                         placement_group_bundle_index=rank)).remote()
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
        return [self.coordinator.pid] if self.coordinator is not None else []

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
            from engine.runtime.lifetime import describe_exit

            return f"DP coordinator process ended ({describe_exit(self.coordinator)})"
        return None

    def join(self, timeout: float) -> None:
        import ray

        if self.runs and ray.is_initialized():
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)

    def shutdown(self) -> None:
        """Kill the actors (their worker processes end with them), remove the placement group, stop the
        coordinator, and Ray itself when this manager started it."""
        import ray

        if ray.is_initialized():
            for actor in self.actors:
                try:
                    ray.kill(actor)
                except Exception:
                    pass
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception:
                    pass
        self.actors, self.runs, self.placement_group = [], [], None
        if self.coordinator is not None:
            self.coordinator.terminate()
            self.coordinator.join(5)
            if self.coordinator.is_alive():
                self.coordinator.kill()
                self.coordinator.join()
            self.coordinator = None
        if self.started_ray and ray.is_initialized():
            time.sleep(0.1)  # let the kills reach the raylet before the driver goes
            ray.shutdown()
            self.started_ray = False
