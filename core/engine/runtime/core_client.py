"""EngineCoreClient: the boundary between the front end and the engine core.

InprocClient runs the core in this process; SyncMPClient and AsyncMPClient start an EngineCoreProc
and talk to it over ZMQ (msgpack). A core process that dies, or reports an error, turns every
pending and future call into EngineDeadError.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
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
from engine.errors import EngineDeadError
from engine.model.model_info import ModelInfo
from engine.runtime.core_proc import EngineCoreProc, encode_request
from engine.runtime.engine_core import EngineCore
from engine.runtime.lifetime import describe_exit, remove_ipc_dir, start_process
from engine.runtime.messages import (OUTPUTS_DECODER, READY_CALL_ID, EngineCoreOutputs, EngineCoreRequest,
                                     EngineCoreRequestType, UtilityCall)
from engine.runtime.messages import SchedulerStats

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


class MPClient:
    """Starts the core process and owns the sockets' addresses; shared by the sync and async clients."""

    def __init__(self, vllm_config: VllmConfig, zmq_context: zmq.Context):
        self.ipc_dir = tempfile.mkdtemp(prefix="engine-ipc-")
        self.input_address = f"ipc://{self.ipc_dir}/input"
        self.output_address = f"ipc://{self.ipc_dir}/output"
        self.ctx = zmq_context
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(self.output_address)
        spawn = multiprocessing.get_context("spawn")
        # not a daemon: it starts worker processes of its own; it watches this process and ends with it
        self.proc = spawn.Process(target=EngineCoreProc.run_engine_core, name="EngineCore",
                                  args=(vllm_config, self.input_address, self.output_address,
                                        logging.getLogger("engine").getEffectiveLevel(), os.getpid(),
                                        self.ipc_dir), daemon=False)
        try:
            start_process(self.proc)
        except BaseException:
            remove_ipc_dir(self.ipc_dir)
            raise
        self.dead_error: Optional[str] = None
        self.call_ids = itertools.count()
        self.cancel_start = threading.Event()  # set from any thread: a start-up wait gives up

    def _wait_ready(self, sync_socket: zmq.Socket) -> None:
        """Block until the core reports ready; EngineDeadError if it failed, died or start-up was cancelled."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.cancel_start.is_set():
                raise EngineDeadError("engine start-up cancelled")
            if sync_socket.poll(200):
                if self._check_ready(OUTPUTS_DECODER.decode(sync_socket.recv())):
                    return
            elif not self.proc.is_alive():
                raise EngineDeadError(f"engine core process ended during start-up ({describe_exit(self.proc)})")
        raise EngineDeadError(f"engine core not ready after {STARTUP_TIMEOUT_S}s")

    def _check_ready(self, outputs: EngineCoreOutputs) -> bool:
        if outputs.engine_error:
            raise EngineDeadError(f"engine core failed to start: {outputs.engine_error}")
        return outputs.utility_output is not None and outputs.utility_output.call_id == READY_CALL_ID

    def _mark_dead(self, reason: str) -> EngineDeadError:
        self.dead_error = self.dead_error or reason
        return EngineDeadError(self.dead_error)

    def _stop_process(self, graceful: bool = True) -> None:
        if self.proc.is_alive() and graceful:
            try:
                self.input_socket.send_multipart(encode_request(EngineCoreRequestType.SHUTDOWN, None), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        remove_ipc_dir(self.ipc_dir)


class SyncMPClient(MPClient, EngineCoreClient):
    """Blocking client: a reader thread drains the output socket and watches the core process."""

    def __init__(self, vllm_config: VllmConfig):
        super().__init__(vllm_config, zmq.Context())
        self.outputs: queue.Queue = queue.Queue()
        self.pending_calls: dict[int, queue.Queue] = {}
        try:
            self._wait_ready(self.output_socket)
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
        while self.dead_error is None:
            if not self.output_socket.poll(100):
                if not self.proc.is_alive():
                    self._fail(f"engine core process died ({describe_exit(self.proc)})")
                continue
            outputs = OUTPUTS_DECODER.decode(self.output_socket.recv())
            if outputs.engine_error:
                self._fail(f"engine core died: {outputs.engine_error}")
            elif outputs.utility_output is not None:
                waiter = self.pending_calls.pop(outputs.utility_output.call_id, None)
                if waiter is not None:
                    waiter.put(outputs.utility_output)
            else:
                self.outputs.put(outputs)

    def _fail(self, reason: str) -> None:
        error = self._mark_dead(reason)
        self.outputs.put(error)
        for waiter in list(self.pending_calls.values()):
            waiter.put(error)

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        self.input_socket.send_multipart(encode_request(kind, payload))

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead_error:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if isinstance(item, EngineDeadError):
            self.outputs.put(item)  # every later call fails the same way
            raise item
        return item

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self.call_ids)
        waiter: queue.Queue = queue.Queue()
        self.pending_calls[call_id] = waiter
        self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
        result = waiter.get()
        if isinstance(result, EngineDeadError):
            raise result
        if result.error:
            raise RuntimeError(f"engine core {method} failed: {result.error}")
        return msgspec.convert(result.result, _UTILITY_TYPES.get(method, Any))

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def shutdown(self) -> None:
        self._stop_process()
        self.dead_error = self.dead_error or "engine shut down"
        self.ctx.destroy(linger=0)


class AsyncMPClient(MPClient):
    """asyncio client for AsyncLLM: ``get_output_async`` awaits the next batch of outputs."""

    def __init__(self, vllm_config: VllmConfig):
        """Returns once the core process is started (it loads the model meanwhile): call ``wait_ready()``
        before using the client, or ``abort_start()`` to give up."""
        super().__init__(vllm_config, zmq.asyncio.Context())
        self.pending_calls: dict[int, asyncio.Future] = {}

    def wait_ready(self) -> None:
        """Block until the core reports ready (or raise EngineDeadError if it failed to start)."""
        # start-up happens before the event loop serves anyone: a blocking wait through a sync socket view
        self._wait_ready(zmq.Socket.shadow(self.output_socket.underlying))

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            if self.dead_error:
                raise EngineDeadError(self.dead_error)
            if not await self.output_socket.poll(100):
                if not self.proc.is_alive():
                    raise self._fail(f"engine core process died ({describe_exit(self.proc)})")
                continue
            outputs = OUTPUTS_DECODER.decode(await self.output_socket.recv())
            if outputs.engine_error:
                raise self._fail(f"engine core died: {outputs.engine_error}")
            if outputs.utility_output is not None:
                future = self.pending_calls.pop(outputs.utility_output.call_id, None)
                if future is not None and not future.done():
                    future.set_result(outputs.utility_output)
                continue
            return outputs

    def _fail(self, reason: str) -> EngineDeadError:
        error = self._mark_dead(reason)
        for future in self.pending_calls.values():
            if not future.done():
                future.set_exception(error)
        return error

    async def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead_error:
            raise EngineDeadError(self.dead_error)
        await self.input_socket.send_multipart(encode_request(kind, payload))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead_error:
            await self._send(EngineCoreRequestType.ABORT, request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Needs someone awaiting ``get_output_async`` (AsyncLLM's output handler) to resolve."""
        call_id = next(self.call_ids)
        future = asyncio.get_running_loop().create_future()
        self.pending_calls[call_id] = future
        await self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, method, list(args)))
        result = await future
        if result.error:
            raise RuntimeError(f"engine core {method} failed: {result.error}")
        return msgspec.convert(result.result, _UTILITY_TYPES.get(method, Any))

    def shutdown(self) -> None:
        self._stop_process()
        self.dead_error = self.dead_error or "engine shut down"
        self.ctx.destroy(linger=0)

    def abort_start(self) -> None:
        """Stop a core that is still starting, from any thread (no event loop needed: the asyncio
        sockets are left to the garbage collector)."""
        self._stop_process(graceful=False)
        self.dead_error = self.dead_error or "engine start-up aborted"


def make_client(vllm_config: VllmConfig, model_info: Optional[ModelInfo] = None) -> EngineCoreClient:
    """In process unless ``parallel.engine_core_process`` asks for a separate engine-core process."""
    if vllm_config.parallel.engine_core_process:
        return SyncMPClient(vllm_config)
    return InprocClient(vllm_config, model_info)
