"""EngineCoreProc: the engine core in its own process, fed and read over ZMQ."""
from __future__ import annotations

import logging
import traceback
from typing import Any

import msgspec
import zmq

from engine.config import VllmConfig
from engine.runtime.engine_core import EngineCore
from engine.runtime.lifetime import (exit_on_sigterm, remove_ipc_dir, use_thread_lock_for_progress_bars,
                                     watch_parent)
from engine.runtime.messages import (ENCODER, READY_CALL_ID, REQUEST_DECODERS, EngineCoreOutputs,
                                     EngineCoreRequestType, UtilityCall, UtilityOutput)
from engine.runtime.messages import EngineCoreOutput

logger = logging.getLogger(__name__)
UTILITY_METHODS = {"get_stats", "reset_prefix_cache", "check_health"}
_IDLE_POLL_MS = 500


class EngineCoreProc(EngineCore):
    """Busy loop: take every pending message, run one step if there is work, send the outputs."""

    def __init__(self, vllm_config: VllmConfig, input_address: str, output_address: str):
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 1000)  # unsent messages to a front end that is gone never block exit
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(output_address)
        try:
            super().__init__(vllm_config)
        except BaseException as exc:
            self._send_last_words(f"{type(exc).__name__}: {exc}")
            raise
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.running = True
        self._send(EngineCoreOutputs([], utility_output=UtilityOutput(READY_CALL_ID, self.kv_cache_config.num_blocks)))

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.output_socket.send(ENCODER.encode(outputs), copy=False)

    def _send_last_words(self, error: str) -> None:
        """Tell the front end why this core is going down, without blocking if nobody listens any more."""
        try:
            self.output_socket.send(ENCODER.encode(EngineCoreOutputs([], engine_error=error)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _handle(self, frames: list[bytes]) -> None:
        try:
            kind = EngineCoreRequestType(frames[0])
            payload = REQUEST_DECODERS[kind].decode(frames[1])
        except (ValueError, IndexError, msgspec.DecodeError) as exc:  # ValidationError is a DecodeError
            self._refuse_message(frames, exc)
            return
        if kind is EngineCoreRequestType.ADD:
            self.add_request(payload)
        elif kind is EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
        elif kind is EngineCoreRequestType.UTILITY:
            self._send(EngineCoreOutputs([], utility_output=self._call_utility(payload)))
        else:
            self.running = False

    def _refuse_message(self, frames: list[bytes], exc: Exception) -> None:
        """A message that does not decode fails its request (when it names one), never the core."""
        request_id = None
        try:
            raw = msgspec.msgpack.decode(frames[1])
            request_id = raw.get("request_id") if isinstance(raw, dict) else None
        except Exception:
            pass
        logger.warning("engine core: refused a malformed message (request %s): %s", request_id, exc)
        if isinstance(request_id, str):
            self._send(EngineCoreOutputs([EngineCoreOutput(request_id, [], "error", error=f"invalid request: {exc}")]))

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
        poller.register(self.input_socket, zmq.POLLIN)
        while self.running:
            busy = self.has_work()
            if dict(poller.poll(0 if busy else _IDLE_POLL_MS)):  # block only when idle
                while self.running:
                    try:
                        self._handle(self.input_socket.recv_multipart(flags=zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if self.running and self.has_work():
                outputs = self.step()
                if outputs.outputs:
                    self._send(outputs)

    @staticmethod
    def run_engine_core(vllm_config: VllmConfig, input_address: str, output_address: str, log_level: int,
                        parent_pid: int, ipc_dir: str) -> None:
        """Process entry point: ends with its parent from the first instant (loading included), and
        removes the IPC folder on every exit path."""
        exit_on_sigterm()
        core = None
        try:  # everything inside: a SIGTERM at any instant still reaches the finally
            watch_parent(parent_pid, "engine core", cleanup=lambda: remove_ipc_dir(ipc_dir))
            use_thread_lock_for_progress_bars()
            logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                                datefmt="%H:%M:%S")
            core = EngineCoreProc(vllm_config, input_address, output_address)
            core.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as exc:
            logger.error("engine core died: %s\n%s", exc, traceback.format_exc())
            if core is not None:
                core._send_last_words(f"{type(exc).__name__}: {exc}")
        finally:
            try:
                if core is not None:
                    core.shutdown()
                    core.ctx.destroy(linger=1000)
            finally:
                remove_ipc_dir(ipc_dir)


def encode_request(kind: EngineCoreRequestType, payload: Any) -> list[bytes]:
    return [kind.value, ENCODER.encode(payload)]
