"""DPCoordinator: gathers the engine cores' load reports and publishes them to every front end.

Engine cores push an ``EngineLoad`` after steps that changed their queues or prefix cache (at most every
``REPORT_INTERVAL_S``); the coordinator keeps each rank's latest and publishes the whole ``DPState`` on a PUB
socket at most every ``PUBLISH_INTERVAL_S`` when something changed, and at least every
``HEARTBEAT_INTERVAL_S`` (a front end that subscribes late gets the state within that time).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from typing import Optional

import zmq

from engine.lifetime import (
    exit_on_sigterm,
    leave_interrupts_to_the_parent,
    set_process_name,
    start_process,
    watch_parent,
)
from engine.messages import ENCODER, LOAD_DECODER, DPState, EngineLoad, EngineZmqAddresses

logger = logging.getLogger(__name__)
PUBLISH_INTERVAL_S = 0.05
HEARTBEAT_INTERVAL_S = 1.0


class DPCoordinator:
    """The latest load of each DP rank, and when it last went out."""

    def __init__(self, num_ranks: int):
        self.loads: list[Optional[EngineLoad]] = [None] * num_ranks
        self.changed = False
        self.last_publish = 0.0

    def receive(self, load: EngineLoad) -> None:
        if not 0 <= load.dp_rank < len(self.loads):
            logger.warning("DP coordinator: a load report from unknown rank %d", load.dp_rank)
            return
        previous = self.loads[load.dp_rank]
        if load.prefix_bits is None and previous is not None:  # the summary did not change: keep the last one
            load.prefix_bits, load.prefix_num_bits = previous.prefix_bits, previous.prefix_num_bits
        self.loads[load.dp_rank] = load
        self.changed = True

    def due(self, now: float) -> bool:
        since = now - self.last_publish
        return (self.changed and since >= PUBLISH_INTERVAL_S) or since >= HEARTBEAT_INTERVAL_S

    def state(self, now: float) -> DPState:
        self.changed, self.last_publish = False, now
        return DPState(list(self.loads))


def run_dp_coordinator(
    num_ranks: int, input_address: str, output_address: str, parent_pid: int, log_level: int
) -> None:
    """Process entry point: serve until SIGTERM or until the parent (the engine's launcher) is gone."""
    exit_on_sigterm()
    leave_interrupts_to_the_parent()
    set_process_name("DPCoordinator")
    ctx = zmq.Context()
    try:
        watch_parent(parent_pid, "DP coordinator")
        logging.basicConfig(
            level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
        reports = ctx.socket(zmq.PULL)
        reports.bind(input_address)
        publisher = ctx.socket(zmq.PUB)
        publisher.setsockopt(zmq.SNDHWM, 16)  # a slow front end misses states, never blocks the others
        publisher.bind(output_address)
        coordinator = DPCoordinator(num_ranks)
        while True:
            if reports.poll(int(PUBLISH_INTERVAL_S * 1000)):
                while True:
                    try:
                        coordinator.receive(LOAD_DECODER.decode(reports.recv(flags=zmq.NOBLOCK)))
                    except zmq.Again:
                        break
            now = time.monotonic()
            if coordinator.due(now):
                publisher.send(ENCODER.encode(coordinator.state(now)))
    except SystemExit:
        pass
    finally:
        ctx.destroy(linger=0)


def start_dp_coordinator(data_parallel_size: int, addresses: EngineZmqAddresses):
    """The DP coordinator process (None without data parallelism), a child of this process."""
    if addresses.coordinator_input is None:
        return None
    coordinator = multiprocessing.get_context("spawn").Process(
        target=run_dp_coordinator,
        name="DPCoordinator",
        daemon=True,
        args=(
            data_parallel_size,
            addresses.coordinator_input,
            addresses.coordinator_output,
            os.getpid(),
            logging.getLogger("engine").getEffectiveLevel(),
        ),
    )
    start_process(coordinator)
    return coordinator
