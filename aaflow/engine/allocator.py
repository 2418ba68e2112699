"""Keep the heap's freed memory for the next forward pass instead of handing it back to the OS.

glibc serves blocks above its mmap threshold (128 KiB at first) with fresh mappings and trims freed
memory at the heap's top past 128 KiB, so a long prefill's multi-megabyte activations page-fault on
every pass; keeping that memory makes a long prefill measurably faster (docs/RESULTS-history.md).
vLLM's CPU backend preloads tcmalloc for the same reason.

`AAFLOW_MALLOC_TUNING=0` leaves the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV_VAR = "AAFLOW_MALLOC_TUNING"
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's upper limit on 64-bit
TRIM_THRESHOLD_BYTES = 512 * 2**20  # freed memory kept at the heap's top
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_tuned = False


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process once; True when it is tuned (False on other C libraries
    or when `AAFLOW_MALLOC_TUNING=0`)."""
    global _tuned
    if _tuned:
        return True
    if os.environ.get(ENV_VAR, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _tuned
