"""What a replica answers to each call (`aaflow.runtime.calls`): one frozen dataclass per reply
that has parts. A call whose answer is one value names it in its `Reply`: a token list (a decode
step), a length (a session opened), a list of records (a fork), nothing (close, free, release).
The built-in, vLLM and simulated replicas answer with these; the scheduler, `af.*` and
calibration read them by field.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaflow.operators import FidelityReport


@dataclass(frozen=True)
class RefRecord:
    """A KVRef as seen from another process: enough to address it, size it and rebuild it (the
    reply of materialize and compose, a fork's per ref, and a receive's `record`)."""

    id: str
    replica: str
    fingerprint: str
    token_ids: tuple[int, ...]
    nbytes: int
    fidelity: FidelityReport | None  # None: exact KV
    computed: int = 0  # tokens the call that made it computed (materialize: prefix-cache hits excluded)

    @property
    def exact(self) -> bool:
        return self.fidelity is None


@dataclass(frozen=True)
class PrefillReply:
    """One prompt segment prefilled: tokens computed and served by the prefix cache, the call's
    seconds, and the first generated token when the segment completed the prompt (else None)."""

    computed: int
    reused: int
    seconds: float
    token: int | None = None


@dataclass(frozen=True)
class MixedReply:
    """A decode step and prompt segments in one pass: each decoding session's new token, in the
    call's `sids` order, and each segment's `PrefillReply`, in its `requests` order."""

    tokens: list[int]
    prefills: list[PrefillReply]


@dataclass(frozen=True)
class StepsReply:
    """Up to `steps` decode steps in one call: each session's new tokens (in `sids` order) and the
    seconds from the call's start to each step's end."""

    tokens: list[list[int]]
    ends_s: list[float]


@dataclass(frozen=True)
class Exposure:
    """A ref made readable by a peer: the transport's handle, the `KVShape` the receiver checks
    before any byte lands, and the ref's record. `release(handle)` ends it. (The simulated replica
    answers the ref's token ids as the handle, a `SimShape` and no record.)"""

    handle: object
    shape: object
    record: RefRecord


@dataclass(frozen=True)
class Received:
    """A peer's KV fetched as a new ref here: its record and the transport's `TransferStats`. (The
    simulated replica answers a `SimRecord` and the transfer's `SimShape`: both have what the
    scheduler reads, `record.id` and `stats.nbytes`.)"""

    record: RefRecord
    stats: object
