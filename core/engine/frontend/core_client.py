"""EngineCoreClient: the boundary between the front end and the engine core.

InprocClient runs the core in this process; SyncMPClient and AsyncMPClient start one EngineCoreProc per
data-parallel rank (and the DP coordinator) and talk to them over ZMQ (msgpack), routing each request to a
rank. A core process that dies, or reports an error, turns every pending and future call into
EngineDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Optional

import msgspec
import zmq
import zmq.asyncio

from engine.config import VllmConfig
from engine.data_parallel.router import DPRouter
from engine.engine_core.core_proc import encode_request
from engine.engine_core.engine_core import EngineCore
from engine.errors import EngineDeadError
from engine.lifetime import remove_ipc_dir
from engine.messages import (
    DP_STATE_DECODER,
    OUTPUTS_DECODER,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineZmqAddresses,
    SchedulerStats,
    UtilityCall,
    UtilityOutput,
    engine_identity,
)
from engine.model.model_info import ModelInfo
from engine.processes.core_launcher import EngineProcWatch, engine_core_addresses, start_engine_cores

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600
_UTILITY_TYPES = {"get_stats": SchedulerStats, "reset_prefix_cache": bool, "check_health": bool}


class EngineCoreClient(ABC):
    """What a front end may ask of an engine core, wherever the core runs."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def get_stats(self) -> SchedulerStats: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in this process: ``get_output`` runs one step."""

    def __init__(self, vllm_config: VllmConfig, model_info: Optional[ModelInfo] = None):
        self.engine_core = EngineCore(vllm_config, model_info)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class RemoteEngines(msgspec.Struct):
    """Engine cores started by another process (``engine serve``'s launcher), joined as front end ``client_index``."""

    addresses: EngineZmqAddresses
    client_index: int
    pids: list[int]  # engine cores by DP rank, then the DP coordinator


class MPClient:
    """This front end's sockets, the engine cores behind them, and the DP router.

    It binds a ROUTER (each engine core's DEALER connects, named by its DP rank, and announces itself with a
    READY message once loaded) and a PULL socket for outputs; with data parallelism it subscribes to the DP
    coordinator's state, which the router uses. It starts the engine cores (and the coordinator) itself, or
    joins ones another process started (``RemoteEngines``) and watches them by pid.
    """

    def __init__(self, vllm_config: VllmConfig, zmq_context: zmq.Context, remote: Optional[RemoteEngines] = None):
        self.num_ranks = vllm_config.parallel.data_parallel_size
        self.identities = [engine_identity(rank) for rank in range(self.num_ranks)]
        self.ctx = zmq_context
        self.ipc_dir: Optional[str] = None  # IPC sockets' folder, when this client starts the cores
        if remote is None:
            self.ipc_dir = ipc_dir = tempfile.mkdtemp(prefix="engine-ipc-")
            addresses = engine_core_addresses(vllm_config, ipc_dir, 1)
        else:
            addresses = remote.addresses
        client = 0 if remote is None else remote.client_index
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to a gone core raises, never vanishes
        self.input_socket.bind(addresses.inputs[client])
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(addresses.outputs[client])
        self.state_socket: Any = None  # the DP coordinator's published load (an asyncio socket for AsyncMPClient)
        if addresses.coordinator_output is not None:
            self.state_socket = self.ctx.socket(zmq.SUB)
            self.state_socket.setsockopt(zmq.SUBSCRIBE, b"")
            self.state_socket.connect(addresses.coordinator_output)
        self.router = DPRouter(vllm_config) if self.num_ranks > 1 else None
        self.owns_engines = remote is None
        if remote is None:
            try:
                self.engines = start_engine_cores(vllm_config, addresses, ipc_dir)
            except BaseException:
                remove_ipc_dir(self.ipc_dir)
                raise
        else:
            self.engines = EngineProcWatch(remote.pids, self.num_ranks)
        self.dead_error: Optional[str] = None
        self.call_ids = itertools.count()
        self.cancel_start = threading.Event()  # set from any thread: a start-up wait gives up

    @property
    def proc(self):
        """The (first) engine-core process, when this client started it."""
        return self.engines.procs[0] if self.owns_engines else None

    def _wait_ready(self, input_socket: zmq.Socket, output_socket: zmq.Socket) -> None:
        """Block until every core announced itself; EngineDeadError if one failed, died or start-up was cancelled."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(input_socket, zmq.POLLIN)
        poller.register(output_socket, zmq.POLLIN)
        ready: set[bytes] = set()
        while len(ready) < self.num_ranks:
            if self.cancel_start.is_set():
                raise EngineDeadError("engine start-up cancelled")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"engine core not ready after {STARTUP_TIMEOUT_S}s")
            events = dict(poller.poll(200))
            if output_socket in events:
                outputs = OUTPUTS_DECODER.decode(output_socket.recv())
                if outputs.engine_error:
                    raise EngineDeadError(f"engine core failed to start: {outputs.engine_error}")
            if input_socket in events:
                frames = input_socket.recv_multipart()
                if len(frames) >= 2 and frames[1] == EngineCoreRequestType.READY.value:
                    ready.add(frames[0])
            if not events:
                failure = self.engines.first_failure()
                if failure is not None:
                    raise EngineDeadError(f"{failure} during start-up")

    def _mark_dead(self, reason: str) -> EngineDeadError:
        self.dead_error = self.dead_error or reason
        return EngineDeadError(self.dead_error)

    def _frames(self, rank: int, kind: EngineCoreRequestType, payload: Any) -> list[bytes]:
        return [self.identities[rank], *encode_request(kind, payload)]

    def _unreachable(self, rank: int, exc: zmq.ZMQError) -> EngineDeadError:
        return self._mark_dead(self.engines.first_failure() or f"engine core of DP rank {rank} unreachable: {exc}")

    def _route(self, request: EngineCoreRequest) -> int:
        return self.router.route(request) if self.router is not None else 0

    def _ranks_of(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The requests to abort, by the rank serving each (ones that already finished are left out)."""
        if self.router is None:
            return {0: list(request_ids)}
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.router.rank_of(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
                self.router.finished(request_id)
        return by_rank

    def _note_outputs(self, outputs: EngineCoreOutputs) -> None:
        if self.router is not None:
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.router.finished(output.request_id)

    def _note_state(self, message: bytes) -> None:
        try:
            state = DP_STATE_DECODER.decode(message)
        except msgspec.DecodeError as exc:
            logger.warning("ignored a malformed DP state: %s", exc)
            return
        if self.router is not None:
            self.router.update(state)

    def _utility_call(self, method: str, args: tuple[Any, ...]) -> UtilityCall:
        """A utility call with a fresh id (the answer comes back on the output socket under it)."""
        return UtilityCall(next(self.call_ids), method, list(args))

    @classmethod
    def _utility_result(cls, method: str, answers: list[UtilityOutput]) -> Any:
        """One answer from every rank's UtilityOutput; RuntimeError for the first that failed."""
        results: list[Any] = []
        for answer in answers:
            if answer.error:
                raise RuntimeError(f"engine core {method} failed: {answer.error}")
            results.append(msgspec.convert(answer.result, _UTILITY_TYPES.get(method, Any)))
        return cls._combine(method, results)

    @staticmethod
    def _combine(method: str, results: list[Any]) -> Any:
        """One answer from the answers of every rank."""
        if method == "get_stats":
            return results[0] if len(results) == 1 else SchedulerStats.total(results)
        if method in ("reset_prefix_cache", "check_health"):
            return all(results)
        return results if len(results) > 1 else results[0]

    def shutdown(self) -> None:
        self._stop_process()
        self.dead_error = self.dead_error or "engine shut down"
        self.ctx.destroy(linger=0)

    def _stop_process(self, graceful: bool = True) -> None:
        if not self.owns_engines:
            return  # the launcher that started them stops them
        if graceful and self.engines.first_failure() is None:
            for rank in range(self.num_ranks):
                try:
                    self.input_socket.send_multipart(
                        self._frames(rank, EngineCoreRequestType.SHUTDOWN, None), flags=zmq.NOBLOCK
                    )
                except zmq.ZMQError:
                    pass
            self.engines.join(5)
        self.engines.shutdown()


class SyncMPClient(MPClient, EngineCoreClient):
    """Blocking client: a reader thread drains the output (and DP state) sockets and watches the cores."""

    def __init__(self, vllm_config: VllmConfig, remote: Optional[RemoteEngines] = None):
        super().__init__(vllm_config, zmq.Context(), remote)
        self.outputs: queue.Queue = queue.Queue()
        self.pending_calls: dict[int, queue.Queue] = {}
        self.lock = threading.Lock()  # the router and the input socket, shared by the caller and the reader
        try:
            self._wait_ready(self.input_socket, self.output_socket)
        except BaseException:
            self._stop_process(graceful=False)
            raise
        self.reader = threading.Thread(target=self._read_outputs, name="EngineCoreOutputReader", daemon=True)
        self.reader.start()

    def _read_outputs(self) -> None:
        try:
            self._read_loop()
        except zmq.ZMQError:
            pass  # the context was closed by shutdown

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        if self.state_socket is not None:
            poller.register(self.state_socket, zmq.POLLIN)
        while self.dead_error is None:
            events = dict(poller.poll(100))
            if self.state_socket is not None and self.state_socket in events:
                with self.lock:
                    self._note_state(self.state_socket.recv())
            if self.output_socket not in events:
                failure = self.engines.first_failure()
                if failure is not None:
                    self._fail(failure)
                continue
            outputs = OUTPUTS_DECODER.decode(self.output_socket.recv())
            if outputs.engine_error:
                self._fail(f"engine core died: {outputs.engine_error}")
            elif outputs.utility_output is not None:
                waiter = self.pending_calls.pop(outputs.utility_output.call_id, None)
                if waiter is not None:
                    waiter.put(outputs.utility_output)
            else:
                with self.lock:
                    self._note_outputs(outputs)
                self.outputs.put(outputs)

    def _fail(self, reason: str) -> None:
        error = self._mark_dead(reason)
        self.outputs.put(error)
        for waiter in list(self.pending_calls.values()):
            waiter.put(error)

    def _send(self, rank: int, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        try:
            self.input_socket.send_multipart(self._frames(rank, kind, payload))
        except zmq.ZMQError as exc:
            raise self._unreachable(rank, exc) from None

    def add_request(self, request: EngineCoreRequest) -> None:
        with self.lock:
            self._send(self._route(request), EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead_error:
            with self.lock:
                for rank, ids in self._ranks_of(request_ids).items():
                    self._send(rank, EngineCoreRequestType.ABORT, ids)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if isinstance(item, EngineDeadError):
            self.outputs.put(item)  # every later call fails the same way
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        """``method`` on every rank's core; the answers combined (stats added up, flags and-ed)."""
        waiters = []
        for rank in range(self.num_ranks):
            call = self._utility_call(method, args)
            waiter: queue.Queue = queue.Queue()
            self.pending_calls[call.call_id] = waiter
            waiters.append(waiter)
            with self.lock:
                self._send(rank, EngineCoreRequestType.UTILITY, call)
        answers = [waiter.get() for waiter in waiters]  # a death answers every pending call
        dead = next((answer for answer in answers if isinstance(answer, EngineDeadError)), None)
        if dead is not None:
            raise dead
        return self._utility_result(method, answers)

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")


class AsyncMPClient(MPClient):
    """asyncio client for AsyncLLM: ``get_output_async`` awaits the next batch of outputs."""

    def __init__(self, vllm_config: VllmConfig, remote: Optional[RemoteEngines] = None):
        """Returns once the core processes are started (they load the model meanwhile): call ``wait_ready()``
        before using the client, or ``abort_start()`` to give up."""
        super().__init__(vllm_config, zmq.asyncio.Context(), remote)
        self.pending_calls: dict[int, asyncio.Future] = {}

    def wait_ready(self) -> None:
        """Block until every core reports ready (or raise EngineDeadError if one failed to start)."""
        # start-up happens before the event loop serves anyone: a blocking wait through sync socket views
        self._wait_ready(
            zmq.Socket.shadow(self.input_socket.underlying), zmq.Socket.shadow(self.output_socket.underlying)
        )

    async def get_output_async(self) -> EngineCoreOutputs:
        poller = zmq.asyncio.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        if self.state_socket is not None:
            poller.register(self.state_socket, zmq.POLLIN)
        while True:
            if self.dead_error:
                raise EngineDeadError(self.dead_error)
            events = dict(await poller.poll(100))
            if self.state_socket is not None and self.state_socket in events:
                self._note_state(await self.state_socket.recv())
            if self.output_socket not in events:
                failure = self.engines.first_failure()
                if failure is not None:
                    raise self._fail(failure)
                continue
            outputs = OUTPUTS_DECODER.decode(await self.output_socket.recv())
            if outputs.engine_error:
                raise self._fail(f"engine core died: {outputs.engine_error}")
            if outputs.utility_output is not None:
                future = self.pending_calls.pop(outputs.utility_output.call_id, None)
                if future is not None and not future.done():
                    future.set_result(outputs.utility_output)
                continue
            self._note_outputs(outputs)
            return outputs

    def _fail(self, reason: str) -> EngineDeadError:
        error = self._mark_dead(reason)
        for future in self.pending_calls.values():
            if not future.done():
                future.set_exception(error)
        return error

    async def _send(self, rank: int, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        try:
            await self.input_socket.send_multipart(self._frames(rank, kind, payload))
        except zmq.ZMQError as exc:
            raise self._unreachable(rank, exc) from None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(self._route(request), EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead_error:
            for rank, ids in self._ranks_of(request_ids).items():
                await self._send(rank, EngineCoreRequestType.ABORT, ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """``method`` on every rank's core, answers combined. Needs someone awaiting ``get_output_async``
        (AsyncLLM's output handler) to resolve."""
        futures = []
        for rank in range(self.num_ranks):
            call = self._utility_call(method, args)
            future = asyncio.get_running_loop().create_future()
            self.pending_calls[call.call_id] = future
            futures.append(future)
            await self._send(rank, EngineCoreRequestType.UTILITY, call)
        return self._utility_result(method, list(await asyncio.gather(*futures)))

    def abort_start(self) -> None:
        """Stop cores that are still starting, from any thread (no event loop needed: the asyncio
        sockets are left to the garbage collector)."""
        self._stop_process(graceful=False)
        self.dead_error = self.dead_error or "engine start-up aborted"


def make_client(vllm_config: VllmConfig, model_info: Optional[ModelInfo] = None) -> EngineCoreClient:
    """In process unless ``parallel.engine_core_process`` asks for a separate engine-core process (data
    parallelism always runs its cores in processes, one per rank)."""
    if vllm_config.parallel.engine_core_process or vllm_config.parallel.data_parallel_size > 1:
        return SyncMPClient(vllm_config)
    return InprocClient(vllm_config, model_info)
