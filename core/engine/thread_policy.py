"""CPU thread policy: OpenMP worker threads sleep when idle instead of spinning.

libgomp (torch's OpenMP runtime on Linux) reads ``OMP_WAIT_POLICY`` once, when torch loads it. Unset, an
idle worker thread spins for a while after each parallel region; with another busy process on the machine
those spinning threads take the time slices that the engine's own main thread (Python between the kernels)
needs, and every parallel region waits for a thread that is not running. ``import engine`` therefore sets
``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it. It takes effect in every process the
engine starts (engine core, workers, `engine serve`) and in the importing process when torch was not
imported before ``engine``. ``OMP_WAIT_POLICY=ACTIVE`` restores spinning.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

DEFAULT_WAIT_POLICY = "PASSIVE"

# whether torch (and so OpenMP) was loaded before ``import engine`` set the policy in this process
_torch_loaded_first = False
_set_by_engine = False


def apply_default_wait_policy() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy (``import engine`` calls it)."""
    global _torch_loaded_first, _set_by_engine
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    _set_by_engine = True
    _torch_loaded_first = "torch" in sys.modules


def warn_if_not_in_effect() -> None:
    """Log once when this process's OpenMP was loaded before the policy was set (its threads spin)."""
    global _torch_loaded_first
    if _set_by_engine and _torch_loaded_first:
        _torch_loaded_first = False
        logger.info(
            "torch was imported before engine, so this process's OpenMP threads spin when idle and take "
            "cores from the decode step's kernels (a single stream decodes up to 1.5x slower, more when "
            "other processes share the cores): set OMP_WAIT_POLICY=PASSIVE in the environment, or import "
            "engine first"
        )
