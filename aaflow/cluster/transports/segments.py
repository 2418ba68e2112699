"""Scatter lists: a logical byte stream laid out as (address, nbytes) pieces of registered memory.

A replica's sequence KV is not one contiguous tensor in its pool: it is one run of slots per
layer and K/V (`PagedKVCache.byte_segments`). Transports that can read scattered memory
(`Transport.supports_segments`) move it pool to pool with no staging copy on either side.
"""

from __future__ import annotations

import hashlib
import struct

import torch

Segments = list[tuple[int, int]]  # (address, nbytes), in stream order


def total_nbytes(segments: Segments) -> int:
    return sum(n for _, n in segments)


def check_inside(segments: Segments, buffer: torch.Tensor, what: str) -> None:
    """Raise ValueError unless every segment is non-empty and lies inside `buffer`."""
    if not segments:
        raise ValueError(f"{what}: no segments: there is nothing to transfer")
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes
    for addr, n in segments:
        if n <= 0 or addr < start or addr + n > end:
            raise ValueError(f"{what}: segment ({addr:#x}, {n}) is empty or outside the registered buffer "
                             f"[{start:#x}, {end:#x})")


def pair_up(local: Segments, remote: Segments) -> tuple[Segments, Segments]:
    """Split two scatter lists of one total size at each other's boundaries: equal-sized pieces,
    pairwise (what a one-sided READ of descriptor lists needs)."""
    if total_nbytes(local) != total_nbytes(remote):
        raise ValueError(f"scatter lists differ in size: {total_nbytes(local)} vs {total_nbytes(remote)} bytes")
    out_local, out_remote = [], []
    i = j = 0
    (la, ln), (ra, rn) = local[0], remote[0]
    while True:
        n = min(ln, rn)
        out_local.append((la, n))
        out_remote.append((ra, n))
        la, ln, ra, rn = la + n, ln - n, ra + n, rn - n
        if ln == 0:
            i += 1
            if i == len(local):
                return out_local, out_remote
            la, ln = local[i]
        if rn == 0:
            j += 1
            ra, rn = remote[j]


def digest(segments: Segments) -> int:
    """64-bit digest of a scatter list: the source confirms it exposed exactly these pieces."""
    packed = b"".join(struct.pack("<QQ", a, n) for a, n in segments)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")
