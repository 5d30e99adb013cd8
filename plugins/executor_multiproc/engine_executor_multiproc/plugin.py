"""MultiprocExecutor: one worker process per rank (tensor_parallel_size x pipeline_parallel_size).

Each call goes to every rank over its pipe (the broadcast of the step's work); ranks then meet in
torch.distributed collectives (gloo on the CPU, NCCL on CUDA), pipeline stages in send/recv. Calls do
not wait for each other: a reader thread collects every rank's answers, call after call, so the engine
core can keep one step per pipeline stage in flight. A worker that dies fails the pending calls with
EngineDeadError within a poll interval, and shutdown leaves no process behind.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import socket
import threading
import time
import traceback
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any, Optional

from engine import hookimpl
from engine.errors import EngineDeadError
from engine.interfaces.executor import Executor
from engine.lifetime import (
    describe_exit,
    end_engine_process_quickly,
    leave_interrupts_to_the_parent,
    start_process,
    use_thread_lock_for_progress_bars,
    watch_parent,
)

ENGINE_CONTRACT_VERSION = "1.0"
logger = logging.getLogger(__name__)
_POLL_S = 0.1
_STARTUP_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_main(
    vllm_config, plugin_choices: dict, rank: int, init_method: str, conn, log_level: int, parent_pid: int
) -> None:
    """A worker process: build the Worker, then serve calls until told to stop or the parent goes (it is
    watched from the first instant, so a parent killed while this worker loads takes it along)."""
    watch_parent(parent_pid, f"worker rank {rank}")
    leave_interrupts_to_the_parent()
    end_engine_process_quickly()
    use_thread_lock_for_progress_bars()
    logging.basicConfig(
        level=log_level, format=f"%(levelname)s %(asctime)s rank{rank} %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    from engine.worker.worker import Worker

    try:
        worker = Worker(vllm_config, plugin_choices, rank=rank, distributed_init_method=init_method)
        worker.init_device()
        worker.load_model()
        conn.send(("ready", None))
    except BaseException as exc:
        conn.send(("error", f"rank {rank} failed to start: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # the executor is gone
        if message is None:
            break
        method, args, kwargs = message
        try:
            conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except BaseException as exc:
            conn.send(("error", f"rank {rank} {method} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    worker.shutdown()


class MultiprocExecutor(Executor):
    """Workers in spawned processes, one per rank; the output rank's results are the step's results."""

    name = "multiproc"
    priority = 10

    def _init_executor(self) -> None:
        world = self.vllm_config.parallel.world_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        spawn = multiprocessing.get_context("spawn")
        self.workers, self.conns = [], []
        self.dead: Optional[str] = None
        for rank in range(world):
            parent_conn, child_conn = spawn.Pipe()
            proc = spawn.Process(
                target=worker_main,
                name=f"EngineWorker-{rank}",
                daemon=True,
                args=(
                    self.vllm_config,
                    self.plugin_choices,
                    rank,
                    init_method,
                    child_conn,
                    logging.getLogger().getEffectiveLevel(),
                    os.getpid(),
                ),
            )
            start_process(proc)  # the child does not re-run the user's main script
            child_conn.close()
            self.workers.append(proc)
            self.conns.append(parent_conn)
        self.pending_calls: queue.SimpleQueue = queue.SimpleQueue()  # Futures of calls sent, in order
        self.send_lock = threading.Lock()  # a call reaches every rank before the next one starts
        self.reader: Optional[threading.Thread] = None
        try:
            self._gather(_STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.reader = threading.Thread(target=self._read_answers, name="multiproc-answers", daemon=True)
        self.reader.start()
        logger.info("multiproc executor: %d worker processes ready", world)

    def _read_answers(self) -> None:
        """Resolve the pending calls in order, each with one answer from every rank."""
        while True:
            future = self.pending_calls.get()
            if future is None:
                return
            if self.dead:
                future.set_exception(EngineDeadError(self.dead))
                continue
            try:
                future.set_result(self._gather())
            except BaseException as exc:
                future.set_exception(exc)

    def _gather(self, timeout: Optional[float] = None) -> list[Any]:
        """One answer from every rank; any rank's error or death fails at once (no waiting on its peers,
        which may be blocked in a collective with it)."""
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        by_conn = {conn: rank for rank, conn in enumerate(self.conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self.workers)}
        while len(results) < len(self.conns):
            pending = [conn for conn, rank in by_conn.items() if rank not in results]
            ready: list[Any] = wait(
                pending + [proc.sentinel for rank, proc in enumerate(self.workers) if rank not in results], _POLL_S
            )
            for item in ready:
                if item in by_sentinel:
                    rank = by_sentinel[item]
                    if self.conns[rank].poll():
                        continue  # it answered before exiting: read that first
                    proc = self.workers[rank]
                    raise self._fail(f"worker rank {rank} (pid {proc.pid}) died ({describe_exit(proc)})")
                rank = by_conn[item]
                try:
                    status, value = item.recv()
                except (EOFError, OSError):
                    proc = self.workers[rank]
                    proc.join(1.0)  # a closed pipe is most often a dead process: say how it died
                    why = f"died ({describe_exit(proc)})" if not proc.is_alive() else "closed its pipe"
                    raise self._fail(f"worker rank {rank} (pid {proc.pid}) {why}") from None
                if status == "error":
                    raise self._fail(value)
                results[rank] = value
            if deadline is not None and time.monotonic() > deadline:
                raise self._fail(f"workers did not answer within {timeout}s")
        return [results[rank] for rank in range(len(self.conns))]

    def _fail(self, reason: str) -> EngineDeadError:
        """Mark the executor dead and kill the workers (the others may wait in a collective for the dead one);
        ``shutdown`` reaps them."""
        if not self.dead:
            self.dead = reason
            logger.error("multiproc executor: %s", reason)
        for proc in getattr(self, "workers", []):
            if proc.is_alive():
                proc.kill()
        return EngineDeadError(self.dead)

    def collective_rpc_async(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> Future:
        if self.dead:
            raise EngineDeadError(self.dead)
        future: Future = Future()
        with self.send_lock:
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send((method, args, kwargs or {}))
                except (BrokenPipeError, OSError):
                    raise self._fail(f"worker rank {rank} is gone") from None
            self.pending_calls.put(future)
        return future

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        return self.collective_rpc_async(method, args, kwargs).result()

    def check_health(self) -> None:
        for rank, proc in enumerate(self.workers):
            if not proc.is_alive():
                raise self._fail(f"worker rank {rank} (pid {proc.pid}) died ({describe_exit(proc)})")

    def shutdown(self) -> None:
        reader = getattr(self, "reader", None)
        if reader is not None:
            self.pending_calls.put(None)
            reader.join(5)  # it returns once the calls sent before are answered (or the workers die)
            self.reader = None
        for conn in getattr(self, "conns", []):
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 3
        for proc in getattr(self, "workers", []):
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in getattr(self, "workers", []):
            if proc.is_alive():  # stuck in a collective with a dead peer
                proc.kill()
                proc.join(5)
        for conn in getattr(self, "conns", []):
            conn.close()
        self.conns, self.workers = [], []


@hookimpl
def engine_executors():
    return [MultiprocExecutor]
