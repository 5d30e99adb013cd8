"""EngineCoreProc: the engine core in its own process, fed and read over ZMQ."""
from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import Any

import zmq

from engine.config import VllmConfig
from engine.runtime.engine_core import EngineCore
from engine.runtime.messages import (ENCODER, READY_CALL_ID, REQUEST_DECODERS, EngineCoreOutputs,
                                     EngineCoreRequestType, UtilityCall, UtilityOutput)

logger = logging.getLogger(__name__)
UTILITY_METHODS = {"get_stats", "reset_prefix_cache", "check_health"}
_PARENT_POLL_MS = 500


class EngineCoreProc(EngineCore):
    """Busy loop: take every pending message, run one step if there is work, send the outputs."""

    def __init__(self, vllm_config: VllmConfig, input_address: str, output_address: str):
        self.ctx = zmq.Context()
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(output_address)
        try:
            super().__init__(vllm_config)
        except BaseException as exc:
            self._send(EngineCoreOutputs([], engine_error=f"{type(exc).__name__}: {exc}"))
            raise
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_address)
        self.parent_pid = os.getppid()
        self.running = True
        self._send(EngineCoreOutputs([], utility_output=UtilityOutput(READY_CALL_ID, self.kv_cache_config.num_blocks)))

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.output_socket.send(ENCODER.encode(outputs), copy=False)

    def _handle(self, frames: list[bytes]) -> None:
        kind = EngineCoreRequestType(frames[0])
        payload = REQUEST_DECODERS[kind].decode(frames[1])
        if kind is EngineCoreRequestType.ADD:
            self.add_request(payload)
        elif kind is EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
        elif kind is EngineCoreRequestType.UTILITY:
            self._send(EngineCoreOutputs([], utility_output=self._call_utility(payload)))
        else:
            self.running = False

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
            # block only when idle; wake up now and then to notice an orphaned core
            if dict(poller.poll(0 if busy else _PARENT_POLL_MS)):
                while self.running:
                    try:
                        self._handle(self.input_socket.recv_multipart(flags=zmq.NOBLOCK))
                    except zmq.Again:
                        break
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: the front-end process is gone; shutting down")
                break
            if self.running and self.has_work():
                outputs = self.step()
                if outputs.outputs:
                    self._send(outputs)

    @staticmethod
    def run_engine_core(vllm_config: VllmConfig, input_address: str, output_address: str, log_level: int) -> None:
        """Process entry point."""
        logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
        core = None
        try:
            core = EngineCoreProc(vllm_config, input_address, output_address)
            core.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as exc:
            logger.error("engine core died: %s\n%s", exc, traceback.format_exc())
            if core is not None:
                core._send(EngineCoreOutputs([], engine_error=f"{type(exc).__name__}: {exc}"))
        finally:
            if core is not None:
                core.shutdown()
                core.ctx.destroy(linger=1000)


def encode_request(kind: EngineCoreRequestType, payload: Any) -> list[bytes]:
    return [kind.value, ENCODER.encode(payload)]
