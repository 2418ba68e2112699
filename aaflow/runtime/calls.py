"""The calls the scheduler sends to a replica: frozen values with an enum kind.

A call names a `ModelReplica` method and its arguments; a backend runs it (the Ray backend on a
replica actor, the simulated clock by predicting its duration). Prompt segments of several
sessions travel as `PrefillRequest`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class CallKind(Enum):
    """What a call does; the value is the replica method that does it."""

    OPEN = "session_open"  # (sid, fork_of ref id or None)
    MATERIALIZE = "materialize"  # (token_ids,): prefill a shared prefix as a KVRef
    COMPOSE = "compose"  # (ref ids, mode, r): one KVRef for the refs' contexts in order
    PREFILL = "session_prefill"  # (sid, token_ids, sampling, reuse_prefix)
    PACK = "session_prefill_many"  # (requests,): several sessions' prompt segments in one pass
    STEP = "session_step"  # (sids,): one batched decode step
    STEPS = "session_steps"  # (sids, steps, stops): up to `steps` decode steps in one call (cluster.multi_step)
    MIXED = "session_step_mixed"  # (sids, requests): a decode step and prompt segments in one pass
    EXPOSE = "expose"  # (ref id, transport): make a ref's blocks readable by another replica
    RECEIVE = "receive"  # (handle, shape, record, transport): fetch exposed blocks as a new ref
    RELEASE = "release"  # (handle, transport): end an exposure
    CLOSE = "session_close"  # (sid,)
    FREE = "free"  # (ref id,)

    def __init__(self, method: str) -> None:
        # Plain attributes, not properties: the scheduler asks them of every call.
        # prefills: prefill calls, which a long prompt may speed up with lent threads
        self.prefills = method in ("materialize", "session_prefill", "session_prefill_many")
        # steps: calls that advance every decoding session of the replica by one token
        self.steps = method in ("session_step", "session_steps", "session_step_mixed")
        # computes: calls that run the model (they compete for the machine's cores)
        self.computes = self.prefills or self.steps or method == "compose"
        # transfers: calls of a prefix transfer between replicas
        self.transfers = method in ("expose", "receive", "release")
        # bookkeeping: calls that only open, close or free (about a millisecond, no model pass)
        self.bookkeeping = method in ("session_open", "session_close", "free")


class PrefillRequest(NamedTuple):
    """One session's prompt segment; `sampling` set when it completes the prompt (the answer then
    carries the first generated token), `reuse_prefix` lets the prefix cache serve it."""

    sid: str
    token_ids: list[int]
    sampling: object = None
    reuse_prefix: bool = True


@dataclass(frozen=True)
class Call:
    """One replica call. `threads` > 0: run it on that many threads (idle replicas lend theirs)."""

    kind: CallKind
    args: tuple = ()
    threads: int = 0

    @property
    def method(self) -> str:
        return self.kind.value

    @property
    def requests(self) -> list[PrefillRequest]:
        """The prompt segments a prefill call carries (one for PREFILL, none for MATERIALIZE)."""
        if self.kind is CallKind.PREFILL:
            return [PrefillRequest(*self.args)]
        if self.kind is CallKind.PACK:
            return list(self.args[0])
        if self.kind is CallKind.MIXED:
            return list(self.args[1])
        return []

    @property
    def sessions(self) -> list[str]:
        """The session ids the call works on."""
        if self.kind in (CallKind.OPEN, CallKind.CLOSE):
            return [self.args[0]]
        if self.kind.steps:
            return list(self.args[0]) + [r.sid for r in self.requests]
        return [r.sid for r in self.requests]

    @property
    def tokens(self) -> int:
        """Prompt tokens a prefill call computes at most (0 for other calls)."""
        if self.kind is CallKind.MATERIALIZE:
            return len(self.args[0])
        return sum(len(r.token_ids) for r in self.requests)

    def with_threads(self, threads: int) -> "Call":
        return Call(self.kind, self.args, threads)
