"""Memory of the exchange's round-sized vectors: reused buffers and the C allocator's thresholds.

A round of a 64 MB module touches a few hundred MB of fresh memory (the flattened delta, the
decoded parts, the average, per-part temporaries); each fresh 4 KiB page costs a page fault and the
kernel's zeroing, a large share of a peer's kernel time (``bench.comm``'s ``cpu_s_per_mb``). Two remedies
live here: :class:`FlatBuffers` keeps the flattened delta's vector from round to round (and, in
``NetAverager``, the average and our decoded contribution once the caller hands them back:
``NetAverager.give_back``), and :func:`keep_freed_memory` pins glibc's thresholds so that part-sized
temporaries (up to 32 MB) come from the heap and stay there between rounds instead of being mapped
and unmapped each time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import torch
from torch import Tensor

__all__ = ["FlatBuffers", "keep_freed_memory"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 * 2**20
"""Allocations above this many bytes are mapped (glibc's largest allowed value): the round's own
vectors; everything smaller comes from the heap."""
TRIM_THRESHOLD = 128 * 2**20
"""Free bytes a heap keeps before giving memory back to the kernel: a round's temporaries."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_tuned = False


def keep_freed_memory() -> bool:
    """Pin glibc's mmap and trim thresholds (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`) once per
    process; True if they are set. glibc's own thresholds move with the largest block freed so far,
    so whether a round's temporaries fault again depended on which temporaries happened to come
    first. Elsewhere than glibc this does nothing and returns False."""
    global _tuned
    if _tuned:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _tuned:
        log.debug("mallopt refused the exchange's thresholds")
    return _tuned


class FlatBuffers:
    """Round-sized fp32 vectors kept from one round to the next, at most ``keep`` per size.

    A fresh vector of a 64 MB module costs the kernel about 16,000 page faults each round; a buffer
    taken here was written before and faults no more. A taken buffer is the taker's alone until it
    gives it back (never give back one that something may still read). The price is memory: up to
    ``keep`` idle vectors per module size between rounds."""

    def __init__(self, keep: int = 1):
        self.keep = keep
        self._free: dict[int, list[Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int) -> Tensor:
        """A CPU fp32 vector of ``numel`` values (contents undefined)."""
        with self._lock:
            free = self._free.get(numel)
            if free:
                return free.pop()
        return torch.empty(numel, dtype=torch.float32)  # (numel,)

    def give(self, buf: Tensor) -> None:
        """Return ``buf`` (from :meth:`take`) for a later round to reuse."""
        with self._lock:
            free = self._free.setdefault(buf.numel(), [])
            if len(free) < self.keep:
                free.append(buf)
