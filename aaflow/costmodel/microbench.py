"""Hardware microbenchmarks the cost model is calibrated with (bytes/s, seconds)."""

from __future__ import annotations

import statistics
import time

import torch


def memcpy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """In-process copy bandwidth in bytes/s between preallocated buffers (the physical bound of any
    transfer on this machine): median of `repeats` after two warm-up copies."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return nbytes / statistics.median(samples)
