"""Source-side bookkeeping shared by the UCX-based transports (`nixl`, `ucx`).

A destination asks the source for a *lease* on an exposure before it reads, and ends
the lease when done. `release` only marks an exposure; its cleanup (deregistration,
dropping the tensor) runs once no lease is left, so memory is never freed under a
reader. A lease lasts as long as the reader said it would wait (plus a grace period),
so a destination that died cannot pin memory (or keep the source spinning) for long.

Also the small fixed-layout control messages both transports exchange (no pickle: a
peer's bytes are parsed, never executed), and `seal`/`unseal` for the opaque blobs a peer
hands to UCX or NIXL (worker addresses, agent metadata): a truncated or garbled one can
abort the process inside UCX or leave NIXL unable to load that peer again, so blobs are
checked before they reach the library.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Cleanup = Callable[[], None]


@dataclass
class _Exposure:
    tensor: torch.Tensor
    cleanup: Cleanup | None
    leases: dict[int, float] = field(default_factory=dict)  # token -> monotonic expiry
    released: bool = False


class LeaseTable:
    """Exposed tensors by handle id, with leases and deferred cleanup. Thread-safe.

    Methods that return cleanups leave running them to the caller (outside this lock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exposures: dict[str, _Exposure] = {}

    def add(self, handle_id: str, tensor: torch.Tensor, cleanup: Cleanup | None) -> None:
        with self._lock:
            self._exposures[handle_id] = _Exposure(tensor, cleanup)

    def acquire(self, handle_id: str, token: int, lease_s: float) -> torch.Tensor | None:
        """Lease the exposure for one read; None if it is unknown or released."""
        with self._lock:
            exposure = self._exposures.get(handle_id)
            if exposure is None or exposure.released:
                return None
            exposure.leases[token] = time.monotonic() + lease_s
            return exposure.tensor

    def end(self, handle_id: str, token: int, grace_s: float = 0.0) -> list[Cleanup]:
        """End a lease now (the read finished), or after `grace_s` (it was abandoned)."""
        with self._lock:
            exposure = self._exposures.get(handle_id)
            if exposure is not None and token in exposure.leases:
                if grace_s > 0:
                    exposure.leases[token] = min(exposure.leases[token], time.monotonic() + grace_s)
                else:
                    del exposure.leases[token]
            return self._collect([handle_id])

    def release(self, handle_id: str) -> list[Cleanup]:
        with self._lock:
            if handle_id in self._exposures:
                self._exposures[handle_id].released = True
            return self._collect([handle_id])

    def expire(self) -> list[Cleanup]:
        """Drop leases past their expiry (their reader is gone or stuck)."""
        now = time.monotonic()
        with self._lock:
            for exposure in self._exposures.values():
                for token in [t for t, expiry in exposure.leases.items() if expiry < now]:
                    del exposure.leases[token]
            return self._collect(list(self._exposures))

    def has_leases(self) -> bool:
        with self._lock:
            return any(exposure.leases for exposure in self._exposures.values())

    def close(self) -> list[Cleanup]:
        """Forget everything, leases included; the caller has stopped all readers."""
        with self._lock:
            cleanups = [e.cleanup for e in self._exposures.values() if e.cleanup is not None]
            self._exposures.clear()
            return cleanups

    def __len__(self) -> int:
        with self._lock:
            return len(self._exposures)

    def _collect(self, handle_ids: list[str]) -> list[Cleanup]:
        cleanups = []
        for handle_id in handle_ids:
            exposure = self._exposures.get(handle_id)
            if exposure is not None and exposure.released and not exposure.leases:
                del self._exposures[handle_id]
                if exposure.cleanup is not None:
                    cleanups.append(exposure.cleanup)
        return cleanups


# -- control messages --------------------------------------------------------------------------
# magic(4) kind(1) status(1) handle_id(16, uuid bytes) token(8) payload(rest)
# `status` is OK/GONE in an ACK; in a BEGIN it is the lease the reader asks for, in seconds.

MAGIC = b"AAFT"
BEGIN, ACK, DONE, ABORT = b"B", b"A", b"D", b"X"
OK, GONE = 1, 0
_HEADER = struct.Struct("<4scB16sQ")
HEADER_NBYTES = _HEADER.size


LEASE_GRACE_S = 5.0


def lease_request(deadline: float) -> int:
    """The lease (whole seconds, 1..255) covering a reader's remaining time plus a grace."""
    return max(1, min(255, int(deadline - time.monotonic() + LEASE_GRACE_S + 1)))


@dataclass(frozen=True)
class Message:
    kind: bytes
    status: int
    handle_id: str
    token: int
    payload: bytes = b""

    def encode(self) -> bytes:
        try:
            hid = bytes.fromhex(self.handle_id)
        except ValueError:  # a forged id: send zeros, which match no exposure
            hid = b""
        hid = hid if len(hid) == 16 else bytes(16)
        return _HEADER.pack(MAGIC, self.kind, self.status, hid, self.token) + self.payload

    @staticmethod
    def decode(data: bytes) -> Message | None:
        """Parse a control message; None for anything that is not one (ignored by callers)."""
        if len(data) < HEADER_NBYTES:
            return None
        magic, kind, status, hid, token = _HEADER.unpack_from(data)
        if magic != MAGIC or kind not in (BEGIN, ACK, DONE, ABORT):
            return None
        return Message(kind, status, hid.hex(), token, bytes(data[HEADER_NBYTES:]))


_SEAL = b"AAFS"
_DIGEST_NBYTES = 8


def seal(blob: bytes) -> bytes:
    """`blob` with a magic and a digest in front, so that damage is detected by `unseal`."""
    return _SEAL + hashlib.blake2b(blob, digest_size=_DIGEST_NBYTES).digest() + blob


def unseal(sealed: bytes) -> bytes | None:
    """The blob given to `seal`, or None if `sealed` is not an intact sealed blob."""
    start = len(_SEAL) + _DIGEST_NBYTES
    if not isinstance(sealed, bytes) or len(sealed) < start or not sealed.startswith(_SEAL):
        return None
    blob = sealed[start:]
    digest = hashlib.blake2b(blob, digest_size=_DIGEST_NBYTES).digest()
    return blob if digest == sealed[len(_SEAL) : start] else None
