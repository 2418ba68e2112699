"""Fault handling for the scheduler: dead replicas, failed transfers, failed agents.

A replica that dies loses its sessions; every agent it ran starts over from its prompt tokens
(its lineage) on a live replica, and consumers that had streamed tokens from it start over too.
A failed transfer degrades to recomputing the prefix where it was going. An agent that fails
stops the run with an error naming it and the consumers that will not run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aaflow.errors import AAFlowError
from aaflow.runtime.calls import Call, CallKind

if TYPE_CHECKING:
    from aaflow.runtime.backend import Ticket
    from aaflow.runtime.scheduler import Scheduler

CLEANUP_TIMEOUT_S = 10.0  # how long closing the sessions of a failed run may take


class AgentFailedError(AAFlowError, RuntimeError):
    """An agent failed; its consumers were stopped."""


class Recovery:
    """What the scheduler does when a replica dies or a call fails."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def cleanup(self) -> None:
        """After a failure: close every session still open on a live replica (bounded wait)."""
        s = self.scheduler
        tickets = [s.backend.submit(a.replica, Call(CallKind.CLOSE, (a.sid,))) for a in s.agents.values()
                   if a.replica is not None and a.replica not in s.dead and a.state != "done"]
        s.backend.wait(tickets, len(tickets), CLEANUP_TIMEOUT_S)

    def _restart(self, agent) -> None:
        """Start an agent over from its prompt (its lineage) on a live replica."""
        if agent in self.scheduler.decoding[agent.replica]:
            self.scheduler.decoding[agent.replica].remove(agent)
        agent.restart()
        self.scheduler.open_if_ready(agent)

    def replica_died(self, rname: str) -> None:
        s = self.scheduler
        s.events.append(f"{s.now():.2f}s replica {rname} died; recomputing its agents elsewhere")
        s.dead.add(rname)
        s.queues.drop_replica(rname)
        s.prefixes.replica_died(rname)
        lost = [a for a in s.placed[rname] if a.state != "done"]
        for agent in lost:
            self._restart(agent)
            for name in agent.consumers:  # they streamed tokens that will be produced again
                consumer = s.agents[name]
                if consumer.state not in ("new", "done") and consumer not in lost and consumer.fed:
                    s.queues.call(consumer.replica, CallKind.CLOSE, consumer.sid)
                    self._restart(consumer)

    def call_failed(self, ticket: Ticket, exc: BaseException) -> None:
        s = self.scheduler
        if ticket.call.kind.transfers:  # fall back to recomputing the prefix where it was going
            s.events.append(f"{s.now():.2f}s transfer via {ticket.replica} failed ({exc}); recomputing instead")
            s.prefixes.transfer_failed()
            return
        sessions = set(ticket.call.sessions)
        involved = [a.name for a in s.agents.values() if a.sid in sessions and a.replica == ticket.replica]
        failed = involved or [a.name for a in s.placed[ticket.replica] if a.state != "done"]
        waiting = sorted({c for name in failed for c in s.agents[name].consumers})
        raise AgentFailedError(
            f"agent(s) {failed} on replica {ticket.replica} failed: {type(exc).__name__}: {exc}; "
            f"their consumers {waiting} were stopped"
        ) from exc
