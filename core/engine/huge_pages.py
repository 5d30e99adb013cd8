"""Transparent huge pages for the quantized weights a CPU decode step streams.

A decode step reads every weight once, from memory, in a few long streams. In 4 KiB pages each 4 KiB of a stream is
another translation (a page walk, which a virtual machine's nested paging makes several times dearer) and the end of
the hardware prefetcher's run. On a 2-core AMD EPYC virtual machine a sum over 256 MiB read 22 GB/s on one thread in
4 KiB pages and 33 GB/s in 2 MiB pages (38 against 65 GB/s on two threads).

Linux gives 2 MiB pages to an anonymous mapping that asks for them (``madvise(MADV_HUGEPAGE)``) where transparent
huge pages are ``always`` or ``madvise`` (``/sys/kernel/mm/transparent_hugepage/enabled``); glibc's heap, where
torch's tensors live, never asks. So:

- ``HugePageArena`` places tensors one after another in 2 MiB-aligned, advised mappings (64 MiB each, or the size of
  a larger tensor): weights copied there at load share pages, so even a product's 70 KiB weight sits in a huge page
  beside the next product's. A mapping is returned to the system when the last tensor in it is freed; pages of it
  that nothing was placed in are never touched, so they take no memory.
- ``apply_huge_page_policy``: whether this process places weights so (the CPU worker applies ``device.huge_pages``);
  where the kernel offers no huge pages, or the policy is off, ``in_huge_pages`` returns the tensor itself.

Only the quantized products' weights go there (what a single stream of a GGUF or int8 model reads); the float
GEMM's panels and the KV cache stay in ordinary pages. On that machine a huge page took about 4 ms to fault in
(2 GiB: 4.0 s, against 0.46 s for ``torch.zeros``): with the cache written at allocation, a W1 engine started 6.5 s
later; left to the steps that first touch each page, W1 ran 10% slower; a single stream gained at most a few
percent from it. The float32 panels of SmolLM2 (540 MB) took 2 s more to load in huge pages, for a W1 within its
noise (1.03x in float32, 0.98x in bfloat16).
"""

from __future__ import annotations

import logging
import mmap
import pathlib
import threading
from typing import Optional

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 * 2**20
ARENA_MAPPING_BYTES = 64 * 2**20
ALIGNMENT = 64  # each placed tensor starts on a cache line
THP_SETTING = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")

_enabled = False


def transparent_huge_pages() -> Optional[str]:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``); None where there is none."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    selected = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return selected[0] if selected else None


def huge_pages_available() -> bool:
    """Whether an advised anonymous mapping gets 2 MiB pages here."""
    return transparent_huge_pages() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def apply_huge_page_policy(enabled: bool) -> bool:
    """Place this process's streamed quantized weights in huge pages (``enabled``) or not; returns whether they will
    be (False where the kernel offers none)."""
    global _enabled
    _enabled = bool(enabled) and huge_pages_available()
    if enabled and not _enabled:
        logger.info(
            "transparent huge pages unavailable (%s): the quantized weights stay in 4 KiB pages",
            transparent_huge_pages() or "no kernel setting",
        )
    return _enabled


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` (rounded up to whole 2 MiB pages) of zeroed uint8 memory in a 2 MiB-aligned mapping advised for huge
    pages, whatever the policy (the bandwidth benchmark's arrays use it too). The mapping lives while any tensor
    viewing it does."""
    size = _round_up(max(nbytes, 1), HUGE_PAGE)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until the last view of it is freed
    offset = (-whole.data_ptr()) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE, offset, size)  # before any page is touched
    return whole[offset : offset + size]


class HugePageArena:
    """Tensors copied one after another into advised 2 MiB-aligned mappings (``place``), each on a cache line."""

    def __init__(self, mapping_bytes: int = ARENA_MAPPING_BYTES):
        self.mapping_bytes = mapping_bytes
        self._region: Optional[torch.Tensor] = None
        self._used = 0
        self._lock = threading.Lock()

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` in the arena (same shape, dtype and values)."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            start = _round_up(self._used, ALIGNMENT)
            if self._region is None or start + nbytes > self._region.numel():
                # a new mapping; the rest of the old one is never touched, and goes with its last tensor
                self._region = huge_page_bytes(max(nbytes, self.mapping_bytes))
                start = 0
            self._used = start + nbytes
            slot = self._region[start : start + nbytes]
        placed = slot.view(tensor.dtype).view(tensor.shape)
        placed.copy_(tensor)
        return placed


_arena = HugePageArena()


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A weight the decode step streams, copied into the process's huge-page arena where the policy places tensors
    there (else ``tensor`` itself)."""
    if not _enabled or tensor.device.type != "cpu" or tensor.numel() == 0:
        return tensor
    return _arena.place(tensor.contiguous())
