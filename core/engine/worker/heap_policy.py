"""CPU heap policy: a CPU worker keeps the memory its step frees for the next step instead of returning it.

glibc's malloc serves a large request (from 128 KiB, a threshold it raises as such blocks are freed, up to 32 MiB)
with its own ``mmap`` and hands it back to the kernel when freed, and it gives the top of its heap back once more
than twice that threshold is free there. A decode step allocates and frees the same large tensors every step
(the logits, their float32 copy, the sampler's buffers): each new mapping is faulted in and zeroed page by page.
At 64 requests of a bfloat16 model that was about 10% of the step (``scripts/profile_decode_step.py``: the
kernel's page clearing and faults, 85 ms a step with this policy against 95 without it).

``apply_heap_policy`` fixes both thresholds (``mallopt``: ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``), so
requests below ``MMAP_THRESHOLD`` come from the heap and up to ``TRIM_THRESHOLD`` of freed memory stays mapped.
It acts on the calling process only (a CPU worker's: the engine core's, or the caller's own with ``LLM``), never on
the environment, so processes the engine starts for other purposes (a benchmark's peer) keep glibc's defaults.
Elsewhere than glibc it does nothing. ``device.keep_freed_memory=false`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from typing import Optional

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 * 2**20  # requests below this size come from the heap (a 256-row step's logits of a 150k vocab)
TRIM_THRESHOLD = 512 * 2**20  # freed memory kept mapped at the heap's top, at most

_applied = False


def _glibc() -> Optional[ctypes.CDLL]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def apply_heap_policy() -> bool:
    """Fix glibc's mmap and trim thresholds in this process (once); False where malloc is not glibc's or refused."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.info("glibc refused the heap thresholds; a step's large tensors are mapped anew each step")
        return False
    _applied = True
    logger.debug(
        "heap policy: mmap threshold %d MiB, trim threshold %d MiB", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20
    )
    return True


def release_freed_memory() -> bool:
    """Hand the memory that loading freed back to the system once (glibc's ``malloc_trim``): the policy's trim
    threshold would keep up to 512 MiB of it mapped for steps that never need it (the copies a load makes of each
    weight before the packed or huge-page copy it keeps). False where malloc is not glibc's."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    libc.malloc_trim(0)
    return True
