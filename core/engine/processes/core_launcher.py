"""Start and watch the engine-core processes (one per DP rank) and the DP coordinator.

``CoreEngineProcManager`` owns them (the process that creates it is their parent: AsyncLLM or LLM, or
``engine serve``'s launcher when several API servers share the port); ``EngineProcWatch`` lets a process
that does not own them (an API server) notice that one is gone.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
from multiprocessing.process import BaseProcess
from typing import Optional

from engine.config import VllmConfig
from engine.data_parallel.coordinator import start_dp_coordinator
from engine.lifetime import describe_exit, remove_ipc_dir, shutdown_at_exit, start_process, stop_processes
from engine.messages import EngineZmqAddresses
from engine.processes.ray_engine_cores import RayEngineCoreManager, make_tcp_addresses

logger = logging.getLogger(__name__)


def make_addresses(ipc_dir: str, num_front_ends: int, data_parallel_size: int) -> EngineZmqAddresses:
    """IPC addresses in ``ipc_dir`` for ``num_front_ends`` front ends and, with DP, the coordinator."""
    with_coordinator = data_parallel_size > 1
    return EngineZmqAddresses(
        inputs=[f"ipc://{ipc_dir}/input-{i}" for i in range(num_front_ends)],
        outputs=[f"ipc://{ipc_dir}/output-{i}" for i in range(num_front_ends)],
        coordinator_input=f"ipc://{ipc_dir}/coordinator-in" if with_coordinator else None,
        coordinator_output=f"ipc://{ipc_dir}/coordinator-out" if with_coordinator else None,
    )


def engine_core_addresses(vllm_config: VllmConfig, ipc_dir: str, num_front_ends: int) -> EngineZmqAddresses:
    """IPC addresses for local engine cores; TCP addresses on this node's IP for Ray-placed ones."""
    size = vllm_config.parallel.data_parallel_size
    if vllm_config.parallel.data_parallel_backend == "ray":
        return make_tcp_addresses(num_front_ends, size)
    return make_addresses(ipc_dir, num_front_ends, size)


def start_engine_cores(vllm_config: VllmConfig, addresses: EngineZmqAddresses, ipc_dir: str):
    """The engine cores of every DP rank (and the coordinator), as ``parallel.data_parallel_backend`` says."""
    if vllm_config.parallel.data_parallel_backend == "ray":
        return RayEngineCoreManager(vllm_config, addresses)
    return CoreEngineProcManager(vllm_config, addresses, ipc_dir)


class CoreEngineProcManager:
    """The engine cores of every DP rank and, with more than one, the DP coordinator: started, watched, stopped."""

    def __init__(self, vllm_config: VllmConfig, addresses: EngineZmqAddresses, ipc_dir: str):
        self.ipc_dir = ipc_dir
        self.vllm_config = vllm_config
        self.addresses = addresses
        self.log_level = logging.getLogger("engine").getEffectiveLevel()
        size = vllm_config.parallel.data_parallel_size
        self.coordinator = None
        self.procs: list[BaseProcess] = []
        self.exit_hook = shutdown_at_exit(self)  # a script that simply ends stops them too
        try:
            self.coordinator = start_dp_coordinator(size, addresses)
            for rank in range(size):
                self.procs.append(self._start_rank(rank))
        except BaseException:
            self.shutdown()
            raise

    def _start_rank(self, rank: int) -> BaseProcess:
        from engine.engine_core.core_proc import EngineCoreProc

        size = self.vllm_config.parallel.data_parallel_size
        config = self.vllm_config.model_copy(deep=True)
        config.parallel.data_parallel_rank = rank
        # not a daemon: it starts worker processes of its own; it watches this process and ends with it
        proc = multiprocessing.get_context("spawn").Process(
            target=EngineCoreProc.run_engine_core,
            name="EngineCore" if size == 1 else f"EngineCore_DP{rank}",
            daemon=False,
            args=(config, self.addresses, self.log_level, os.getpid(), self.ipc_dir),
        )
        start_process(proc)
        return proc

    def restart(self, rank: int) -> int:
        """Start rank ``rank``'s engine core again (the old process is reaped first); its new pid."""
        old = self.procs[rank]
        stop_processes([old], grace=1)
        proc = self._start_rank(rank)
        self.procs[rank] = proc
        return proc.pid or 0

    def failed_ranks(self) -> dict[int, tuple[int, str]]:
        """Ranks whose engine-core process ended: rank -> (its pid, why)."""
        return {
            rank: (
                proc.pid or 0,
                f"engine core {rank_name(rank, len(self.procs))}process ended ({describe_exit(proc)})",
            )
            for rank, proc in enumerate(self.procs)
            if not proc.is_alive()
        }

    def coordinator_failure(self) -> Optional[str]:
        """Why the DP coordinator is gone (the engine cannot route any more), or None."""
        if self.coordinator is not None and not self.coordinator.is_alive():
            return f"DP coordinator process ended ({describe_exit(self.coordinator)})"
        return None

    @property
    def pids(self) -> list[int]:
        """Engine cores first (by rank), then the coordinator."""
        started = [*self.procs, self.coordinator]
        return [p.pid for p in started if p is not None and p.pid is not None]

    def first_failure(self) -> Optional[str]:
        """Why the engine cannot serve any more (a core or the coordinator ended), or None."""
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                return f"engine core {rank_name(rank, len(self.procs))}process ended ({describe_exit(proc)})"
        if self.coordinator is not None and not self.coordinator.is_alive():
            return f"DP coordinator process ended ({describe_exit(self.coordinator)})"
        return None

    def join(self, timeout: float) -> None:
        for proc in self.procs:
            proc.join(timeout)

    def shutdown(self) -> None:
        """Stop every process still running (SIGTERM, then SIGKILL), and remove the IPC folder."""
        atexit.unregister(self.exit_hook)
        stop_processes([*self.procs, self.coordinator], grace=5)
        remove_ipc_dir(self.ipc_dir)


class EngineProcWatch:
    """Engine processes started by another process, watched by pid (``/proc``: a zombie counts as ended). A core
    that the launcher restarted tells its new pid in its READY message (``update_pid``)."""

    def __init__(self, pids: list[int], data_parallel_size: int):
        self.pids = list(pids)
        self.size = data_parallel_size

    def update_pid(self, rank: int, pid: int) -> None:
        self.pids[rank] = pid

    def failed_ranks(self) -> dict[int, tuple[int, str]]:
        return {
            rank: (pid, f"engine core {rank_name(rank, self.size)}process (pid {pid}) ended")
            for rank, pid in enumerate(self.pids[: self.size])
            if not pid_alive(pid)
        }

    def coordinator_failure(self) -> Optional[str]:
        for pid in self.pids[self.size :]:
            if not pid_alive(pid):
                return f"DP coordinator process (pid {pid}) ended"
        return None

    def first_failure(self) -> Optional[str]:
        for index, pid in enumerate(self.pids):
            if not pid_alive(pid):
                what = (
                    f"engine core {rank_name(index, self.size)}process"
                    if index < self.size
                    else "DP coordinator process"
                )
                return f"{what} (pid {pid}) ended"
        return None


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc: ask the kernel (a zombie then counts as alive)
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def rank_name(rank: int, size: int) -> str:
    """``of DP rank R `` with data parallelism, nothing without (for messages)."""
    return f"of DP rank {rank} " if size > 1 else ""
