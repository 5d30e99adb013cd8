"""Noisy neighbours for benchmarks: N busy processes (one spinning Python loop each) that run through every
measured run of a command, the engine's and the peers' alike, so contention is measured side by side."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def noisy_neighbours(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` busy processes for the duration of the block; each is killed and reaped on every exit path."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", BUSY_LOOP],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
