"""EngineCoreClient: the boundary between the front end and the engine core.

InprocClient runs the core in this process; SyncMPClient and AsyncMPClient start one EngineCoreProc per
data-parallel rank (and the DP coordinator) and talk to them over ZMQ (msgpack), routing each request to a
rank. A core process that dies takes only its rank down (its requests move to the ranks that are up, and a
core this client started is restarted); with none up and none restarting, every call raises EngineDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import signal
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
import zmq
import zmq.asyncio

from engine.config import VllmConfig
from engine.data_parallel.router import DPRouter
from engine.engine_core.core_proc import encode_request
from engine.engine_core.engine_core import EngineCore
from engine.errors import EngineDeadError, EngineUnavailableError
from engine.lifetime import remove_ipc_dir
from engine.messages import (
    DP_STATE_DECODER,
    OUTPUTS_DECODER,
    READY_DECODER,
    EngineCoreOutput,
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
from engine.processes.core_launcher import (
    CoreEngineProcManager,
    EngineProcWatch,
    engine_core_addresses,
    rank_name,
    start_engine_cores,
)
from engine.processes.supervisor import EngineCoreSupervisor

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600
CHECK_INTERVAL_S = 0.1  # how often the cores' processes are checked (and the longest a poll blocks)
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


@dataclass
class InFlightRequest:
    """A request sent to an engine core: the rank serving it, and the tokens its client received since it was
    (re)sent, which a migration to another rank resumes from."""

    request: EngineCoreRequest
    rank: int
    delivered: list[int] = field(default_factory=list)


class MPClient:
    """This front end's sockets, the engine cores behind them, and the DP router.

    It binds a ROUTER (each engine core's DEALER connects, named by its DP rank, and announces itself with a
    READY message once loaded) and a PULL socket for outputs; with data parallelism it subscribes to the DP
    coordinator's state, which the router uses. It starts the engine cores (and the coordinator) itself, or
    joins ones another process started (``RemoteEngines``) and watches them by pid.

    A core that dies (or sends nothing for ``engine_stall_timeout_s`` with requests in flight: it is killed as
    wedged) takes only its own rank down: the router leaves it out, and each of its requests is re-sent to a
    rank that is up with the tokens its client already has (recomputed as a preempted request is). With no rank
    up, its requests fail (``lost_reason`` says why). The cores this client started are restarted by an
    ``EngineCoreSupervisor``; a restarted core's READY brings its rank back. The engine is dead (every call
    raises EngineDeadError) only when the coordinator ends, or no rank is up and none will restart.
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
        self.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted core takes over its rank's routing id
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
        self.engines: Any
        if remote is None:
            try:
                self.engines = start_engine_cores(vllm_config, addresses, ipc_dir)
            except BaseException:
                remove_ipc_dir(self.ipc_dir)
                raise
        else:
            self.engines = EngineProcWatch(remote.pids, self.num_ranks)
        self.supervisor = (
            EngineCoreSupervisor(self.engines, vllm_config) if isinstance(self.engines, CoreEngineProcManager) else None
        )
        self.dead_error: Optional[str] = None
        self.call_ids = itertools.count()
        self.cancel_start = threading.Event()  # set from any thread: a start-up wait gives up
        # ---- each rank's state, and the requests in flight on it
        self.up = [False] * self.num_ranks  # loaded and routable (every rank once start-up is over)
        self.down_reasons: dict[int, str] = {}  # rank -> why it is down
        self.starting: set[int] = set()  # restarted, not READY yet
        self.handled_deaths: set[tuple[int, int]] = set()  # (rank, pid) of each core whose death was handled
        self.in_flight: dict[str, InFlightRequest] = {}
        self.lost: dict[str, str] = {}  # request id -> why it failed with its core (no rank could take it over)
        self.call_ranks: dict[int, int] = {}  # utility call id -> the rank asked
        self.stall_timeout = vllm_config.parallel.engine_stall_timeout_s
        self.last_heard = [time.monotonic()] * self.num_ranks
        self.last_check = 0.0
        self.num_core_deaths = 0
        self.num_migrated = 0
        self.stopping = False  # shutdown began: cores ending now are not deaths

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
        self.up = [True] * self.num_ranks
        self.last_heard = [time.monotonic()] * self.num_ranks

    def _mark_dead(self, reason: str) -> EngineDeadError:
        self.dead_error = self.dead_error or reason
        return EngineDeadError(self.dead_error)

    def _frames(self, rank: int, kind: EngineCoreRequestType, payload: Any) -> list[bytes]:
        return [self.identities[rank], *encode_request(kind, payload)]

    def _unavailable(self) -> EngineUnavailableError:
        reasons = "; ".join(self.down_reasons.values()) or "not started"
        retry = 1.0
        if self.supervisor is not None and self.supervisor.due:
            retry = max(1.0, min(self.supervisor.due.values()) - time.monotonic())
        return EngineUnavailableError(f"no engine core is up ({reasons}); restarting", retry_after=retry + 4.0)

    # ---- requests in flight ---------------------------------------------------------------------------------
    def _route(self, request: EngineCoreRequest) -> int:
        """The rank for a new request, which is tracked from now on; EngineUnavailableError when no rank is up."""
        if self.router is not None:
            try:
                rank = self.router.route(request)
            except ValueError:
                raise self._unavailable() from None
        elif self.up[0]:
            rank = 0
        else:
            raise self._unavailable()
        self._track(request, rank)
        return rank

    def _track(self, request: EngineCoreRequest, rank: int) -> None:
        self._note_busy(rank)
        self.in_flight[request.request_id] = InFlightRequest(request, rank)

    def _note_busy(self, rank: int) -> None:
        """``rank`` gets a request: if it had none, its silence so far was idleness, not a stall."""
        if not any(entry.rank == rank for entry in self.in_flight.values()):
            self.last_heard[rank] = time.monotonic()

    def _untrack(self, request_id: str) -> Optional[InFlightRequest]:
        return self.in_flight.pop(request_id, None)

    def _ranks_of(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The requests to abort, by the rank serving each (ones that finished, or whose rank is down, left out)."""
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            entry = self._untrack(request_id)
            self.lost.pop(request_id, None)
            if entry is not None and self.up[entry.rank]:
                by_rank.setdefault(entry.rank, []).append(request_id)
        return by_rank

    def _accept_outputs(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Note what each request received (for a migration) and which finished; drop outputs from a core that a
        request was migrated away from (sent before it died, read after)."""
        rank = outputs.engine_index
        if 0 <= rank < self.num_ranks:
            self.last_heard[rank] = time.monotonic()
        kept = []
        for output in outputs.outputs:
            entry = self.in_flight.get(output.request_id)
            if entry is not None:
                if entry.rank != rank:
                    continue
                entry.delivered.extend(output.new_token_ids)
                if output.finish_reason is not None:
                    self._untrack(output.request_id)
            kept.append(output)
        outputs.outputs = kept
        return outputs

    def lost_reason(self, request_id: str) -> Optional[str]:
        """Why ``request_id`` failed when its engine core died (None: it did not fail that way); forgets it."""
        return self.lost.pop(request_id, None)

    # ---- cores dying, wedging and coming back ---------------------------------------------------------------
    def _check_cores(self, force: bool = False) -> tuple[list[tuple[int, EngineCoreRequest]], list[EngineCoreOutput]]:
        """At most every ``CHECK_INTERVAL_S``: handle the cores that died since the last check, kill wedged ones,
        start due restarts. Returns the requests to re-send (rank, request) and the outputs failing the requests
        that no rank could take. EngineDeadError when the engine cannot serve any more."""
        now = time.monotonic()
        if self.stopping or (not force and now - self.last_check < CHECK_INTERVAL_S):
            return [], []
        self.last_check = now
        fatal = self.engines.coordinator_failure()
        if fatal is not None:
            raise self._mark_dead(fatal)
        resend: list[tuple[int, EngineCoreRequest]] = []
        failed: list[EngineCoreOutput] = []
        for rank, (pid, reason) in sorted(self.engines.failed_ranks().items()):
            if (rank, pid) not in self.handled_deaths:
                self.handled_deaths.add((rank, pid))
                self._core_died(rank, reason, resend, failed)
        self._kill_wedged(now)
        if self.supervisor is not None:
            self.starting.update(self.supervisor.start_due_restarts())
            if not any(self.up) and not self.starting and not self.supervisor.due:
                raise self._mark_dead("; ".join(self.supervisor.given_up.values()) or "no engine core is up")
        return resend, failed

    def _core_went_down(
        self, outputs: EngineCoreOutputs
    ) -> tuple[list[tuple[int, EngineCoreRequest]], list[EngineCoreOutput]]:
        """A core's last words (it is ending after an error): its rank is down from now, not when its process
        has ended."""
        resend: list[tuple[int, EngineCoreRequest]] = []
        failed: list[EngineCoreOutput] = []
        rank = outputs.engine_index
        if not self.stopping and 0 <= rank < self.num_ranks and self.up[rank]:
            pid = self.engines.pids[rank] if rank < len(self.engines.pids) else 0
            self.handled_deaths.add((rank, pid))
            reason = f"engine core {rank_name(rank, self.num_ranks)}failed: {outputs.engine_error}"
            self._core_died(rank, reason, resend, failed)
            if self.supervisor is not None and not any(self.up) and not self.supervisor.due:
                raise self._mark_dead(reason)
        return resend, failed

    def _core_died(
        self, rank: int, reason: str, resend: list[tuple[int, EngineCoreRequest]], failed: list[EngineCoreOutput]
    ) -> None:
        self.num_core_deaths += 1
        self.up[rank] = False
        self.down_reasons[rank] = reason
        self.starting.discard(rank)
        if self.router is not None:
            self.router.mark_down(rank)
        self._fail_calls_of(rank, EngineUnavailableError(f"{reason} while answering"))
        victims = [entry for entry in self.in_flight.values() if entry.rank == rank]
        if any(self.up):
            for entry in victims:
                resend.append((self._migrate(entry), entry.request))
            if victims:
                logger.warning("%s: %d request(s) moved to the ranks that are up", reason, len(victims))
        else:
            message = f"{reason}: the request was lost with it (no other engine core could take it over)"
            for entry in victims:
                request_id = entry.request.request_id
                self._untrack(request_id)
                self.lost[request_id] = message
                failed.append(EngineCoreOutput(request_id, [], "error", error=message))
        if self.supervisor is not None:
            self.supervisor.core_died(rank, reason)
        else:
            logger.error("%s", reason)

    def _migrate(self, entry: InFlightRequest) -> int:
        """Re-route ``entry`` to a rank that is up, resuming after the tokens its client has; the new rank."""
        request = entry.request
        resumed = request.resumed_output_token_ids + entry.delivered
        params = msgspec.structs.replace(request.sampling_params, prompt_logprobs=None)  # its client has them
        entry.request = msgspec.structs.replace(request, resumed_output_token_ids=resumed, sampling_params=params)
        entry.delivered = []
        assert self.router is not None  # only DP has another rank
        rank = self.router.route(entry.request)
        self._note_busy(rank)
        entry.rank = rank
        self.num_migrated += 1
        return entry.rank

    def _kill_wedged(self, now: float) -> None:
        if not self.stall_timeout:
            return
        busy = {entry.rank for entry in self.in_flight.values()}
        for rank in busy:
            if self.up[rank] and now - self.last_heard[rank] > self.stall_timeout:
                pid = self.engines.pids[rank]
                logger.error(
                    "engine core of DP rank %d (pid %d) sent nothing for %.0f s with requests in flight: killing it "
                    "as wedged (parallel.engine_stall_timeout_s)",
                    rank,
                    pid,
                    now - self.last_heard[rank],
                )
                self.last_heard[rank] = now
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _core_ready(self, frames: list[bytes]) -> tuple[list[tuple[int, EngineCoreRequest]], list[EngineCoreOutput]]:
        """A (restarted) core announced itself: its rank is up again."""
        resend: list[tuple[int, EngineCoreRequest]] = []
        failed: list[EngineCoreOutput] = []
        if len(frames) < 3 or frames[1] != EngineCoreRequestType.READY.value or frames[0] not in self.identities:
            return resend, failed
        rank = self.identities.index(frames[0])
        try:
            ready = READY_DECODER.decode(frames[2])
        except msgspec.DecodeError:
            return resend, failed
        if isinstance(self.engines, EngineProcWatch):
            old = self.engines.pids[rank]
            if old != ready.pid and (rank, old) not in self.handled_deaths:  # replaced before its death was seen
                self.handled_deaths.add((rank, old))
                self._core_died(
                    rank, f"engine core {rank_name(rank, self.num_ranks)}process (pid {old}) ended", resend, failed
                )
            self.engines.update_pid(rank, ready.pid)
        self.up[rank] = True
        self.starting.discard(rank)
        self.down_reasons.pop(rank, None)
        self.last_heard[rank] = time.monotonic()
        if self.router is not None:
            self.router.mark_up(rank)
        logger.info("engine core %s(pid %d) is up: serving", rank_name(rank, self.num_ranks), ready.pid)
        return resend, failed

    def _fail_calls_of(self, rank: int, error: Exception) -> None:
        """Fail the utility calls waiting on ``rank`` (its core died)."""

    def health(self) -> dict[str, Any]:
        """What ``/health?verbose=1`` shows: each rank's state, deaths, restarts and migrations."""
        ranks = []
        for rank in range(self.num_ranks):
            state = "up" if self.up[rank] else "starting" if rank in self.starting else "down"
            if self.supervisor is not None and rank in self.supervisor.given_up:
                state = "given_up"
            entry: dict[str, Any] = {"rank": rank, "state": state}
            if rank in self.down_reasons:
                entry["reason"] = self.down_reasons[rank]
            ranks.append(entry)
        alive = sum(self.up)
        return {
            "status": "ok" if alive == self.num_ranks else "degraded" if alive else "unavailable",
            "degraded": 0 < alive < self.num_ranks,
            "dp_ranks_alive": alive,
            "data_parallel_size": self.num_ranks,
            "ranks": ranks,
            "engine_core_deaths": self.num_core_deaths,
            "engine_core_restarts": self.supervisor.num_restarts if self.supervisor is not None else None,
            "requests_migrated": self.num_migrated,
        }

    # ---- utility calls ------------------------------------------------------------------------------------------
    def _note_state(self, message: bytes) -> None:
        try:
            state = DP_STATE_DECODER.decode(message)
        except msgspec.DecodeError as exc:
            logger.warning("ignored a malformed DP state: %s", exc)
            return
        if self.router is not None:
            self.router.update(state)

    def _utility_call(self, method: str, args: tuple[Any, ...], rank: int) -> UtilityCall:
        """A utility call with a fresh id (the answer comes back on the output socket under it)."""
        call = UtilityCall(next(self.call_ids), method, list(args))
        self.call_ranks[call.call_id] = rank
        return call

    def _live_ranks(self) -> list[int]:
        """The ranks a utility call goes to; EngineUnavailableError when none is up."""
        ranks = [rank for rank in range(self.num_ranks) if self.up[rank]]
        if not ranks:
            raise self._unavailable()
        return ranks

    @staticmethod
    def _answered(answers: list[Any]) -> list[UtilityOutput]:
        """The answers of the ranks that answered: a rank that died during the call is left out (the call then
        covers the ranks that are up), unless none answered; any other failure is raised."""
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, EngineUnavailableError):
                raise answer
        answered = [answer for answer in answers if isinstance(answer, UtilityOutput)]
        if not answered:
            raise next(a for a in answers if isinstance(a, BaseException))
        return answered

    def _utility_result(self, method: str, answers: list[UtilityOutput]) -> Any:
        """One answer from every rank's UtilityOutput; RuntimeError for the first that failed."""
        results: list[Any] = []
        for answer in answers:
            if answer.error:
                raise RuntimeError(f"engine core {method} failed: {answer.error}")
            results.append(msgspec.convert(answer.result, _UTILITY_TYPES.get(method, Any)))
        return self._combine(method, results)

    def _combine(self, method: str, results: list[Any]) -> Any:
        """One answer from the answers of every live rank (with DP, stats are a total even over one rank)."""
        if method == "get_stats":
            return results[0] if self.num_ranks == 1 else SchedulerStats.total(results)
        if method in ("reset_prefix_cache", "check_health"):
            return all(results)
        return results if len(results) > 1 else results[0]

    def shutdown(self) -> None:
        self.stopping = True
        self._stop_process()
        self.dead_error = self.dead_error or "engine shut down"
        self.ctx.destroy(linger=0)

    def _stop_process(self, graceful: bool = True) -> None:
        self.stopping = True
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
        self.lock = threading.Lock()  # the router, the in-flight table and the input socket: caller and reader
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
        except EngineDeadError as exc:
            self._fail(str(exc))
        except Exception as exc:  # a bug here must not leave the caller waiting for outputs forever
            logger.exception("engine-core output reader failed")
            self._fail(f"output reader failed: {type(exc).__name__}: {exc}")

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        if self.state_socket is not None:
            poller.register(self.state_socket, zmq.POLLIN)
        while self.dead_error is None:
            events = dict(poller.poll(int(CHECK_INTERVAL_S * 1000)))
            with self.lock:  # the input socket (a restarted core's READY) and the cores' states, between sends
                if self.state_socket is not None and self.state_socket in events:
                    self._note_state(self.state_socket.recv())
                while self.input_socket.poll(0):
                    self._apply(*self._core_ready(self.input_socket.recv_multipart()))
                self._apply(*self._check_cores())
            if self.output_socket not in events:
                continue
            outputs = OUTPUTS_DECODER.decode(self.output_socket.recv())
            if outputs.engine_error:
                with self.lock:
                    self._apply(*self._core_went_down(outputs))
            elif outputs.utility_output is not None:
                self.call_ranks.pop(outputs.utility_output.call_id, None)
                waiter = self.pending_calls.pop(outputs.utility_output.call_id, None)
                if waiter is not None:
                    waiter.put(outputs.utility_output)
            else:
                with self.lock:
                    outputs = self._accept_outputs(outputs)
                self.outputs.put(outputs)

    def _apply(self, resend: list[tuple[int, EngineCoreRequest]], failed: list[EngineCoreOutput]) -> None:
        """Send the migrated requests; hand the failed ones to the caller (under the lock)."""
        for rank, request in resend:
            self._send(rank, EngineCoreRequestType.ADD, request)
        if failed:
            self.outputs.put(EngineCoreOutputs(failed))

    def _fail(self, reason: str) -> None:
        error = self._mark_dead(reason)
        self.outputs.put(error)
        for waiter in list(self.pending_calls.values()):
            waiter.put(error)

    def _fail_calls_of(self, rank: int, error: Exception) -> None:
        for call_id, call_rank in list(self.call_ranks.items()):
            if call_rank == rank:
                del self.call_ranks[call_id]
                waiter = self.pending_calls.pop(call_id, None)
                if waiter is not None:
                    waiter.put(error)

    def _send(self, rank: int, kind: EngineCoreRequestType, payload: Any) -> bool:
        """False when the core is unreachable (it died: the watch handles its requests)."""
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        try:
            self.input_socket.send_multipart(self._frames(rank, kind, payload))
            return True
        except zmq.ZMQError as exc:
            logger.warning("engine core of DP rank %d unreachable: %s", rank, exc)
            return False

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
        """``method`` on every live rank's core; the answers combined (stats added up, flags and-ed)."""
        waiters = []
        with self.lock:
            for rank in self._live_ranks():
                call = self._utility_call(method, args, rank)
                waiter: queue.Queue = queue.Queue()
                self.pending_calls[call.call_id] = waiter
                waiters.append(waiter)
                if not self._send(rank, EngineCoreRequestType.UTILITY, call):
                    waiter.put(self._unavailable())
        answers = [waiter.get() for waiter in waiters]  # a death answers every pending call
        return self._utility_result(method, self._answered(answers))

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        with self.lock:  # a restart the reader thread is starting finishes first, and is stopped with the rest
            self.stopping = True
        super().shutdown()


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
        poller.register(self.input_socket, zmq.POLLIN)  # a restarted core's READY
        if self.state_socket is not None:
            poller.register(self.state_socket, zmq.POLLIN)
        while True:
            if self.dead_error:
                raise EngineDeadError(self.dead_error)
            events = dict(await poller.poll(int(CHECK_INTERVAL_S * 1000)))
            if self.state_socket is not None and self.state_socket in events:
                self._note_state(await self.state_socket.recv())
            failed: list[EngineCoreOutput] = []
            if self.input_socket in events:
                failed += await self._apply(*self._core_ready(await self.input_socket.recv_multipart()))
            try:
                failed += await self._apply(*self._check_cores())
                if self.output_socket not in events:
                    if failed:
                        return EngineCoreOutputs(failed)
                    continue
                outputs = OUTPUTS_DECODER.decode(await self.output_socket.recv())
                if outputs.engine_error:
                    failed += await self._apply(*self._core_went_down(outputs))
                    if failed:
                        return EngineCoreOutputs(failed)
                    continue
            except EngineDeadError as exc:
                raise self._fail(str(exc)) from None
            if outputs.utility_output is not None:
                self.call_ranks.pop(outputs.utility_output.call_id, None)
                future = self.pending_calls.pop(outputs.utility_output.call_id, None)
                if future is not None and not future.done():
                    future.set_result(outputs.utility_output)
                if failed:
                    return EngineCoreOutputs(failed)
                continue
            outputs = self._accept_outputs(outputs)
            outputs.outputs.extend(failed)
            return outputs

    async def _apply(
        self, resend: list[tuple[int, EngineCoreRequest]], failed: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        for rank, request in resend:
            await self._send(rank, EngineCoreRequestType.ADD, request)
        return failed

    def _fail(self, reason: str) -> EngineDeadError:
        error = self._mark_dead(reason)
        for future in self.pending_calls.values():
            if not future.done():
                future.set_exception(error)
        return error

    def _fail_calls_of(self, rank: int, error: Exception) -> None:
        for call_id, call_rank in list(self.call_ranks.items()):
            if call_rank == rank:
                del self.call_ranks[call_id]
                future = self.pending_calls.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_exception(error)

    async def _send(self, rank: int, kind: EngineCoreRequestType, payload: Any) -> bool:
        """False when the core is unreachable (it died: the watch handles its requests)."""
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        try:
            await self.input_socket.send_multipart(self._frames(rank, kind, payload))
            return True
        except zmq.ZMQError as exc:
            logger.warning("engine core of DP rank %d unreachable: %s", rank, exc)
            return False

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        await self._send(self._route(request), EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead_error:
            for rank, ids in self._ranks_of(request_ids).items():
                await self._send(rank, EngineCoreRequestType.ABORT, ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """``method`` on every live rank's core, answers combined. Needs someone awaiting ``get_output_async``
        (AsyncLLM's output handler) to resolve."""
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        futures = []
        for rank in self._live_ranks():
            call = self._utility_call(method, args, rank)
            future = asyncio.get_running_loop().create_future()
            self.pending_calls[call.call_id] = future
            futures.append(future)
            if not await self._send(rank, EngineCoreRequestType.UTILITY, call):
                self.pending_calls.pop(call.call_id, None)
                future.set_exception(self._unavailable())
        answers = await asyncio.gather(*futures, return_exceptions=True)
        return self._utility_result(method, self._answered(list(answers)))

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
