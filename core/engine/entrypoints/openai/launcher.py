"""``engine serve --api-server-count K``: K API-server processes on one listening socket.

This process binds the port, starts the engine cores (one per DP rank) and the DP coordinator, then K
API-server processes that inherit the socket (the kernel spreads connections over them) and each join every
engine core as front end ``i``. It stays as their parent: SIGTERM / SIGINT drain the API servers, then stop
the engine; an API server that dies takes the whole server down (exit status 1). An engine core that dies is
restarted here (``parallel.max_restarts``; each API server moves its requests to the ranks that are up and
takes the rank back when the new core announces itself); one that cannot be restarted any more, with no other
rank up, ends the server (exit status 1), as one API server does.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import threading
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from engine.config import VllmConfig
from engine.entrypoints.openai.api_server import serve_on_socket
from engine.entrypoints.openai.metrics import MULTIPROC_DIR_ENV
from engine.frontend.core_client import RemoteEngines
from engine.lifetime import (
    describe_exit,
    end_engine_process_quickly,
    remove_ipc_dir,
    set_process_name,
    start_process,
    stop_processes,
    watch_parent,
)
from engine.processes.core_launcher import CoreEngineProcManager, make_addresses
from engine.processes.supervisor import EngineCoreSupervisor

logger = logging.getLogger("engine.server")
_WATCH_S = 0.5


def run_api_server_process(
    config: VllmConfig, sock: socket.socket, remote: RemoteEngines, parent_pid: int, log_level: int
) -> None:
    """One API server: uvicorn on the shared socket, front end ``remote.client_index`` of the engine."""
    import sys

    set_process_name(f"APIServer_{remote.client_index}")
    end_engine_process_quickly()
    watch_parent(parent_pid, f"API server {remote.client_index}")  # SIGTERM: uvicorn drains and exits
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(levelname)s %(asctime)s api{remote.client_index} %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("engine").setLevel(log_level)
    sys.exit(serve_on_socket(config, sock, remote))


def run_api_servers(config: VllmConfig, sock: socket.socket) -> int:
    count = config.server.api_server_count
    config = config.model_copy(deep=True)
    config.parallel.engine_core_process = True
    ipc_dir = tempfile.mkdtemp(prefix="engine-ipc-")
    addresses = make_addresses(ipc_dir, count, config.parallel.data_parallel_size)
    # the API servers count requests, tokens and latencies in one shared folder (prometheus-client's
    # multiprocess mode): whichever answers /metrics shows the server's; set before they start (and import it)
    metrics_dir = os.path.join(ipc_dir, "metrics")
    os.makedirs(metrics_dir)
    previous_metrics_dir = os.environ.get(MULTIPROC_DIR_ENV)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    engines = None
    servers: list[BaseProcess] = []
    exit_code = 0
    try:
        engines = CoreEngineProcManager(config, addresses, ipc_dir)
        spawn = multiprocessing.get_context("spawn")
        log_level = logging.getLogger("engine").getEffectiveLevel()
        os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # the API servers' environment, not the engine cores'
        for index in range(count):
            remote = RemoteEngines(addresses, index, engines.pids)
            proc = spawn.Process(
                target=run_api_server_process,
                name=f"APIServer-{index}",
                daemon=False,
                args=(config, sock, remote, os.getpid(), log_level),
            )
            start_process(proc)
            servers.append(proc)
        logger.info(
            "%d API servers on http://%s:%d, %d engine core(s) loading",
            count,
            config.server.host,
            config.server.port,
            config.parallel.data_parallel_size,
        )
        supervisor = EngineCoreSupervisor(engines, config)
        handled: set[tuple[int, int]] = set()
        while not stop.is_set():
            if not _supervise(engines, supervisor, handled):
                exit_code = 1
                break
            ended = wait([p.sentinel for p in servers], _WATCH_S)
            if ended and not stop.is_set():
                first = next(p for p in servers if p.sentinel in ended)
                first.join(1)
                code = first.exitcode
                if code != 0:
                    logger.error("%s ended (%s): stopping the server", first.name, describe_exit(first))
                exit_code = 0 if code == 0 else 1
                break
    finally:
        _stop_api_servers(servers, config.server.shutdown_grace_period)
        if engines is not None:
            engines.shutdown()
        remove_ipc_dir(ipc_dir)  # the metrics folder with it
        if previous_metrics_dir is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = previous_metrics_dir
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code


def _supervise(engines: CoreEngineProcManager, supervisor: EngineCoreSupervisor, handled: set) -> bool:
    """Restart the engine cores that died (as the policy allows); False when the engine cannot serve any more."""
    fatal = engines.coordinator_failure()
    if fatal is not None:
        logger.error("the engine cannot serve any more: %s: stopping the server", fatal)
        return False
    for rank, (pid, reason) in sorted(engines.failed_ranks().items()):
        if (rank, pid) not in handled:
            handled.add((rank, pid))
            supervisor.core_died(rank, reason)
    restarted = supervisor.start_due_restarts()
    down = engines.failed_ranks()
    if len(down) == len(engines.procs) and not supervisor.due and not restarted:
        logger.error(
            "the engine cannot serve any more: %s: stopping the server", "; ".join(supervisor.given_up.values())
        )
        return False
    return True


def _stop_api_servers(servers: list[BaseProcess], grace: float) -> None:
    """SIGTERM (each drains for ``grace`` seconds, as one server does), then SIGKILL what is left."""
    stop_processes(servers, grace + 10)
