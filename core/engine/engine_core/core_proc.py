"""EngineCoreProc: the engine core in its own process, fed and read over ZMQ."""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any, Optional

import msgspec
import zmq

from engine.config import VllmConfig
from engine.data_parallel.prefix_summary import PrefixSummary, summary_bits
from engine.engine_core.engine_core import EngineCore
from engine.lifetime import (
    continue_when_parent_dies,
    end_engine_process_quickly,
    exit_on_sigterm,
    leave_interrupts_to_the_parent,
    remove_ipc_dir,
    set_process_name,
    use_thread_lock_for_progress_bars,
    watch_parent,
)
from engine.messages import (
    ENCODER,
    REQUEST_DECODERS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequestType,
    EngineLoad,
    EngineReady,
    EngineZmqAddresses,
    UtilityCall,
    UtilityOutput,
    engine_identity,
)

logger = logging.getLogger(__name__)
UTILITY_METHODS = {"get_stats", "reset_prefix_cache", "check_health", "describe"}
_IDLE_POLL_MS = 500
_REPORT_POLL_MS = 20  # idle, with a load change not reported yet


class EngineCoreProc(EngineCore):
    """Busy loop: take every pending message, run one step if there is work, send the outputs.

    It serves every front end in ``addresses`` (several API servers may share one set of engine cores): a
    DEALER socket, named by the core's DP rank, on each front end's ROUTER, and a PUSH socket to each front
    end's output. A request's outputs go to the front end that sent it. With a DP coordinator, the core
    reports its load there after steps that changed it.
    """

    def __init__(self, vllm_config: VllmConfig, addresses: EngineZmqAddresses):
        self.dp_rank = vllm_config.parallel.data_parallel_rank
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 1000)  # unsent messages to a front end that is gone never block exit
        self.output_sockets = []
        for address in addresses.outputs:
            socket = self.ctx.socket(zmq.PUSH)
            socket.connect(address)
            self.output_sockets.append(socket)
        try:
            super().__init__(vllm_config)
        except BaseException as exc:
            self._send_last_words(f"{type(exc).__name__}: {exc}")
            raise
        self.input_sockets = []
        for address in addresses.inputs:
            socket = self.ctx.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, engine_identity(self.dp_rank))
            socket.connect(address)
            self.input_sockets.append(socket)
        self.load_reporter = (
            LoadReporter(self, self.ctx, addresses.coordinator_input) if addresses.coordinator_input else None
        )
        self.request_clients: dict[str, int] = {}  # request id -> the front end that sent it
        self.running = True
        ready = ENCODER.encode(EngineReady(self.kv_cache_config.num_blocks, os.getpid()))
        for socket in self.input_sockets:  # also tells each front end's ROUTER this core's routing id
            socket.send_multipart([EngineCoreRequestType.READY.value, ready])

    def _send(self, outputs: EngineCoreOutputs, client: int = 0) -> None:
        outputs.engine_index = self.dp_rank
        self.output_sockets[client].send(ENCODER.encode(outputs), copy=False)

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Each request's outputs to the front end that sent it (the step's stats to each of them)."""
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for output in outputs.outputs:
            client = self.request_clients.get(output.request_id, 0)
            if output.finish_reason is not None:
                self.request_clients.pop(output.request_id, None)
            by_client.setdefault(client, []).append(output)
        for client, client_outputs in by_client.items():
            self._send(EngineCoreOutputs(client_outputs, outputs.scheduler_stats), client)

    def _send_last_words(self, error: str) -> None:
        """Tell every front end why this core is going down, without blocking if nobody listens any more."""
        message = ENCODER.encode(EngineCoreOutputs([], engine_error=error, engine_index=self.dp_rank))
        for socket in self.output_sockets:
            try:
                socket.send(message, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _handle(self, frames: list[bytes], client: int = 0) -> None:
        try:
            kind = EngineCoreRequestType(frames[0])
            payload: Any = REQUEST_DECODERS[kind].decode(frames[1])
        except (ValueError, IndexError, KeyError, msgspec.DecodeError) as exc:  # ValidationError is a DecodeError
            self._refuse_message(frames, exc, client)
            return
        if kind is EngineCoreRequestType.ADD:
            if payload.request_id in self.request_clients:  # refused to its sender; the running one keeps its own
                self._send(
                    EngineCoreOutputs(
                        [
                            EngineCoreOutput(
                                payload.request_id,
                                [],
                                "error",
                                error=f"ValueError: request id {payload.request_id!r} is already running",
                            )
                        ]
                    ),
                    client,
                )
                return
            self.request_clients[payload.request_id] = client
            self.add_request(payload)
        elif kind is EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
            for request_id in payload:
                self.request_clients.pop(request_id, None)
        elif kind is EngineCoreRequestType.UTILITY:
            self._send(EngineCoreOutputs([], utility_output=self._call_utility(payload)), client)
        else:
            self.running = False

    def _refuse_message(self, frames: list[bytes], exc: Exception, client: int = 0) -> None:
        """A message that does not decode fails its request (when it names one), never the core."""
        request_id = None
        try:
            raw = msgspec.msgpack.decode(frames[1])
            request_id = raw.get("request_id") if isinstance(raw, dict) else None
        except Exception:
            pass
        logger.warning("engine core: refused a malformed message (request %s): %s", request_id, exc)
        if isinstance(request_id, str):
            self._send(
                EngineCoreOutputs([EngineCoreOutput(request_id, [], "error", error=f"invalid request: {exc}")]), client
            )

    def _call_utility(self, call: UtilityCall) -> UtilityOutput:
        if call.method not in UTILITY_METHODS:
            return UtilityOutput(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityOutput(call.call_id, getattr(self, call.method)(*call.args))
        except Exception as exc:
            return UtilityOutput(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def check_health(self) -> bool:
        self.executor.check_health()
        return True

    def run_busy_loop(self) -> None:
        poller = zmq.Poller()
        for socket in self.input_sockets:
            poller.register(socket, zmq.POLLIN)
        while self.running:
            busy = self.has_work()
            timeout = (
                0 if busy else (_REPORT_POLL_MS if self.load_reporter and self.load_reporter.pending else _IDLE_POLL_MS)
            )
            for socket, _ in poller.poll(timeout):  # block only when idle
                client = self.input_sockets.index(socket)
                while self.running:
                    try:
                        self._handle(socket.recv_multipart(flags=zmq.NOBLOCK), client)
                    except zmq.Again:
                        break
            if self.running and self.has_work():
                outputs = self.step()
                if outputs.outputs:
                    self._send_outputs(outputs)
            if self.load_reporter is not None:
                self.load_reporter.maybe_report()

    @staticmethod
    def run_engine_core(
        vllm_config: VllmConfig, addresses: EngineZmqAddresses, log_level: int, parent_pid: int, ipc_dir: str
    ) -> None:
        """Process entry point: ends with its parent from the first instant (loading included); removes the
        IPC folder when its parent is gone (a living parent removes it itself once it stops its cores)."""
        exit_on_sigterm()
        leave_interrupts_to_the_parent()
        end_engine_process_quickly()
        size = vllm_config.parallel.data_parallel_size
        set_process_name("EngineCore" if size == 1 else f"EngineCore_DP{vllm_config.parallel.data_parallel_rank}")
        continue_when_parent_dies()  # a core its parent paused (SIGSTOP) still ends with it
        if vllm_config.device.niceness:  # before any thread starts: each inherits it (workers too)
            os.nice(vllm_config.device.niceness)
        core = None
        try:  # everything inside: a SIGTERM at any instant still reaches the finally
            watch_parent(parent_pid, "engine core", cleanup=lambda: remove_ipc_dir(ipc_dir))
            use_thread_lock_for_progress_bars()
            logging.basicConfig(
                level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
            )
            core = EngineCoreProc(vllm_config, addresses)
            core.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as exc:
            logger.error("engine core died: %s\n%s", exc, traceback.format_exc())
            if core is not None and core.recorder is not None:
                core.recorder.incident(f"engine core died: {type(exc).__name__}")
            if core is not None:
                core._send_last_words(f"{type(exc).__name__}: {exc}")
        finally:
            try:
                if core is not None:
                    core.shutdown()
                    core.ctx.destroy(linger=1000)
            finally:
                if os.getppid() != parent_pid:  # the parent is gone (else it removes the folder when it stops:
                    remove_ipc_dir(ipc_dir)  # a restarted core of this rank connects to its sockets meanwhile)


class LoadReporter:
    """Pushes this core's load to the DP coordinator: after a change, at most every ``REPORT_INTERVAL_S``; the
    prefix summary only when the prefix cache changed, at most every ``SUMMARY_INTERVAL_S``; a heartbeat
    every ``HEARTBEAT_INTERVAL_S`` regardless."""

    REPORT_INTERVAL_S = 0.02
    SUMMARY_INTERVAL_S = 0.1
    HEARTBEAT_INTERVAL_S = 0.5

    def __init__(self, core: EngineCoreProc, ctx: zmq.Context, address: str):
        self.core = core
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, 64)
        self.socket.connect(address)
        self.pool = core.scheduler.kv_cache_manager.block_pool
        self.num_bits = summary_bits(self.pool.num_blocks)
        self.last_report = self.last_summary = float("-inf")
        self.last_queues: Optional[tuple[int, int]] = None
        self.summary_version = -1
        self.pending = True

    def maybe_report(self) -> None:
        now = time.monotonic()
        scheduler = self.core.scheduler
        queues = (len(scheduler.waiting), len(scheduler.running))
        summary_stale = self.pool.num_cache_changes != self.summary_version
        self.pending = queues != self.last_queues or summary_stale
        if (
            not (self.pending and now - self.last_report >= self.REPORT_INTERVAL_S)
            and now - self.last_report < self.HEARTBEAT_INTERVAL_S
        ):
            return
        bits = None
        if summary_stale and now - self.last_summary >= self.SUMMARY_INTERVAL_S:
            self.summary_version = self.pool.num_cache_changes
            hashes = {block_hash for block_hash, _ in self.pool.cached_block_hash_to_block}
            bits = PrefixSummary.build(hashes, self.num_bits).bits
            self.last_summary = now
        load = EngineLoad(
            self.core.dp_rank,
            queues[0],
            queues[1],
            self.pool.get_usage(),
            bits,
            self.num_bits if bits is not None else 0,
        )
        try:
            self.socket.send(ENCODER.encode(load), flags=zmq.NOBLOCK)
        except zmq.Again:
            return  # the coordinator is behind: the next report carries the state
        self.last_report, self.last_queues = now, queues
        self.pending = self.pool.num_cache_changes != self.summary_version


def encode_request(kind: EngineCoreRequestType, payload: Any) -> list[bytes]:
    return [kind.value, ENCODER.encode(payload)]
