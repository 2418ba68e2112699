"""How the scheduler reaches replicas: submit a call, learn when it ends.

Two backends implement it: `aaflow.cluster.ray_backend.RayBackend` runs each call on a replica actor,
and `aaflow.runtime.sim_backend.SimBackend` predicts each call's duration from a calibrated
hardware profile on a simulated clock. The scheduler never sees which one it drives.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from aaflow.common.errors import AAFlowError
from aaflow.runtime.calls import Call


class ReplicaLostError(AAFlowError, RuntimeError):
    """A call's replica died; its sessions and refs are gone."""


class SessionLostError(ReplicaLostError):
    """A replica has no session of that id: Ray restarted it (empty) since the session opened, so
    it lost its KV as a replica that died does."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What the scheduler knows of a replica: where it runs, on how many threads, and how many KV
    blocks of how many tokens its pool has (None: it does not say; nothing is admitted by size), and
    whether its prefix cache lets agents with one prompt prefix share that prefix's blocks."""

    name: str
    model: str
    engine: str = "builtin"
    node: str | None = None
    threads: int = 1
    kv_blocks: int | None = None
    block_tokens: int = 16
    prefix_cache: bool = True


class Ticket:
    """A submitted call; `seq` orders tickets by submission. Compared by identity."""

    __slots__ = ("seq", "replica", "call")

    def __init__(self, seq: int, replica: str, call: Call) -> None:
        self.seq, self.replica, self.call = seq, replica, call

    def __repr__(self) -> str:
        return f"Ticket({self.seq}, {self.replica!r}, {self.call.kind.name})"


class Backend(ABC):
    """Runs replica calls. One call per replica at a time is the scheduler's rule, not the backend's."""

    @abstractmethod
    def replicas(self) -> list[ReplicaInfo]:
        """The replicas, in cluster order (placement breaks ties by it)."""

    def default_transport(self) -> str:
        """The transport KV moves over between replicas when a run names none. Asked only when a
        prefix is first transferred; a backend that cannot transfer need not answer."""
        raise NotImplementedError(f"{type(self).__name__} names no default transport: pass transport=")

    def prefix_costs(self):
        """The cost model's `aaflow.runtime.prefix_costs.PrefixCosts` for these replicas, or None
        (no calibrated profile): a replica lacking a shared prefix then always has it moved from
        where it is or will be. Asked once, when the first prefix is fetched."""
        return None

    @abstractmethod
    def now(self) -> float:
        """Seconds since the backend started (wall clock or simulated)."""

    @abstractmethod
    def submit(self, replica: str, call: Call) -> Ticket:
        """Start `call` on `replica`; never blocks."""

    @abstractmethod
    def wait(self, tickets: list[Ticket], num_returns: int, timeout_s: float) -> list[Ticket]:
        """Block until `num_returns` of `tickets` have ended or `timeout_s` passed; the ended
        ones, earliest first (possibly fewer than asked for, none on a timeout)."""

    @abstractmethod
    def result(self, ticket: Ticket):
        """An ended call's value; raises ReplicaLostError when its replica died, else the
        exception the call raised. Called once per ticket."""

    def pause(self, seconds: float) -> None:
        """Let `seconds` pass (the scheduler backs off before retrying a preempted agent while
        nothing of its run is in flight)."""
        time.sleep(seconds)

    def revived(self, replica: str, timeout_s: float) -> bool | None:
        """Whether `replica`, lost earlier, serves again (restarted, holding nothing), waiting up
        to `timeout_s` to learn it: True, False (not yet) or None (it never will: this backend's
        replicas are not restarted, or its restarts ran out)."""
        return None
