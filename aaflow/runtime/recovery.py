"""Fault handling for the scheduler: dead replicas, failed transfers, failed agents.

A replica that dies loses its sessions; every agent it ran starts over from its prompt tokens
(its lineage) on a live replica, and consumers that had streamed tokens from it start over too;
once Ray has restarted it (empty), it takes agents again. When no other replica of the model
lives, the agents to place wait for it (`awaiting`, bounded by REVIVE_WAIT_S) without holding the
loop: every other run goes on meanwhile, and each loop turn looks again.
A failed transfer degrades to recomputing the prefix where it was going. A call refused for lack
of KV blocks preempts: the agents whose prompt it carried (for a decode step, the agent placed
last; for a shared prefix, the agents waiting for it) close their sessions and start over once
something of the run on that replica ends, or, when nothing of the run is left running (other runs
hold the KV), after a backoff. An agent that fails stops the run with an error naming it and the
consumers that will not run; the failed run then frees everything it holds on the replicas.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from aaflow.common.errors import AAFlowError, KVCapacityError, KVRefFreedError
from aaflow.runtime.agent_state import AgentPhase, AgentState
from aaflow.runtime.backend import Ticket
from aaflow.runtime.calls import (Call, CloseCall, ComposeCall, ExposeCall, FreeCall, MaterializeCall, MixedCall,
                                  OpenCall, ReceiveCall, ReleaseCall)
from aaflow.runtime.scheduler_state import SchedulerState

CLEANUP_TIMEOUT_S = 10.0  # how long closing the sessions of a failed run may take
MAX_PREEMPTIONS = 50  # an agent preempted this often, and for PREEMPTED_GIVE_UP_S, fails: the KV never
PREEMPTED_GIVE_UP_S = 120.0  # freed up (the pool is too small for what runs on it)
MAX_BACKOFF_S = 2.0  # the longest wait before a preempted agent is tried again (see backoff_s)
REVIVE_WAIT_S = 120.0  # how long placement waits for a restarting replica when no other one lives


class AgentFailedError(AAFlowError, RuntimeError):
    """An agent failed; its consumers were stopped. `agents` names the agents it stopped (the
    failed ones and their consumers): a scheduler serving several runs fails just their runs."""

    def __init__(self, message: str, agents=()) -> None:
        super().__init__(message)
        self.agents = tuple(agents)


@dataclass
class Failure:
    """What to do about a failed call (`Recovery.failure`): preempt these agents (close their
    sessions, start them over once KV frees up), step the replica's decoding agents alone first,
    recompute the prefixes in transit. Nothing of it: the failure needs nothing done."""

    preempt: list[AgentState] = field(default_factory=list)
    step_first: bool = False
    recompute_transfers: bool = False


class Recovery:
    """Decides what a dead replica or a failed call costs; the scheduler carries it out. Owns how
    often each agent was preempted and which replicas are gone for good."""

    def __init__(self, state: SchedulerState, seed: str) -> None:
        self.state = state
        self.preempted: dict[str, int] = {}  # agent -> times preempted
        self.gone: set[str] = set()  # dead replicas that will not be restarted
        self.preempted_since: dict[str, float] = {}  # agent -> when it was first preempted
        self.awaiting: dict[str, tuple[AgentState, float]] = {}  # agent -> (it, deadline): no live replica yet
        self.jitter = random.Random(seed)

    def forget(self, name: str) -> None:
        """An agent's run ended: drop its counts."""
        self.preempted.pop(name, None)
        self.preempted_since.pop(name, None)

    def cleanup(self, inflight: list[Ticket], held: list[tuple[str, Call]]) -> None:
        """After a failure: let the calls in flight end, then close every session still open and
        make the `held` calls (the shared prefixes' frees and releases), bounded waits, so that a
        failed run leaves no KV behind for the runs that share its replicas."""
        s = self.state
        calls = self._made_in_flight(inflight)
        calls += [(a.replica, CloseCall(a.sid)) for a in s.agents.values()
                  if a.replica is not None and a.replica not in s.dead and a.state != AgentPhase.DONE]
        tickets = [s.backend.submit(rname, call) for rname, call in calls + held]
        s.backend.wait(tickets, len(tickets), CLEANUP_TIMEOUT_S)

    def _made_in_flight(self, inflight: list[Ticket]) -> list[tuple[str, Call]]:
        """Wait (bounded) for the run's calls still in flight and name what their results hold on a
        replica (a new ref, an exposure), for cleanup to free it too."""
        s = self.state
        pending = [t for t in inflight if t.replica not in s.dead]
        frees = []
        for ticket in s.backend.wait(pending, len(pending), CLEANUP_TIMEOUT_S) if pending else []:
            try:
                value = s.backend.result(ticket)
            except Exception:  # noqa: BLE001 - a call that failed holds nothing
                continue
            call = ticket.call
            if isinstance(call, (MaterializeCall, ComposeCall, ReceiveCall)):
                record = value.record if isinstance(call, ReceiveCall) else value
                frees.append((ticket.replica, FreeCall(record.id)))
            elif isinstance(call, ExposeCall):
                frees.append((ticket.replica, ReleaseCall(value.handle, call.transport)))
        return frees

    def backoff_s(self, agent: AgentState) -> float:
        """How long a preempted agent waits before it is tried again while nothing of its run is in
        flight (the KV is held by other runs or pins): doubling from 50 ms up to 2 s, jittered so
        that runs waiting on each other do not retry in step."""
        base = min(MAX_BACKOFF_S, 0.05 * 2 ** max(0, self.preempted.get(agent.name, 1) - 1))
        return base * self.jitter.uniform(0.5, 1.5)

    def yield_victims(self, rname: str, keep: AgentState) -> list[AgentState]:
        """Nothing of the run runs and `keep` waits for room on `rname` that other runs hold: the
        run's sessions there give their KV back (they start over later), and so do its shared
        prefixes, so that runs holding KV while waiting for each other cannot wait forever."""
        victims = [a for a in self.state.placed[rname] if a.state in (AgentPhase.OPEN, AgentPhase.DECODING) and a is not keep]
        for agent in victims:
            self.preempted[agent.name] = self.preempted.get(agent.name, 0) + 1
            self.state.note(f"preempted {agent.name} on {rname}: it holds KV while other runs hold what its run "
                            "needs; it starts over later")
        return victims

    def failure(self, ticket: Ticket, exc: BaseException,
                refused_prefix: Callable[[str, list[int]], list[AgentState]]) -> Failure:
        """What to do about `ticket`'s call failing with `exc`. `refused_prefix(replica, tokens)`
        hands back the agents waiting for a shared prefix whose materialize was refused. Raises
        AgentFailedError when agents fail (the call was theirs, or preempting does not help)."""
        if isinstance(ticket.call, FreeCall) and isinstance(exc, KVRefFreedError):
            self.state.note(f"{ticket.replica} was restarted: no prefix left to free")
            return Failure()
        if isinstance(exc, KVCapacityError) and not ticket.call.kind.transfers:
            return self._kv_short(ticket, exc, refused_prefix)
        if ticket.call.kind.transfers:  # fall back to recomputing the prefix where it was going
            self.state.note(f"transfer via {ticket.replica} failed ({exc}); recomputing instead")
            return Failure(recompute_transfers=True)
        return self._failed(ticket, exc)

    def _kv_short(self, ticket: Ticket, exc: KVCapacityError, refused_prefix) -> Failure:
        """The replica refused a call for lack of KV blocks: preempt (see the module docstring)."""
        s, call = self.state, ticket.call
        on_replica = {a.sid: a for a in s.agents.values() if a.replica == ticket.replica and a.state != AgentPhase.DONE}
        if call.kind.steps and not call.requests:
            decoding = [on_replica[sid] for sid in call.sessions if sid in on_replica]
            victims = [max(decoding, key=lambda a: a.order)] if decoding else []
        else:
            victims = [on_replica[r.sid] for r in call.requests if r.sid in on_replica]
            if isinstance(call, OpenCall) and call.sid in on_replica:
                victims = [on_replica[call.sid]]
            if isinstance(call, MaterializeCall):
                victims = refused_prefix(ticket.replica, call.token_ids)
        if not victims:
            self._failed(ticket, exc)
        for agent in victims:
            count = self.preempted[agent.name] = self.preempted.get(agent.name, 0) + 1
            since = self.preempted_since.setdefault(agent.name, s.now())
            if count > MAX_PREEMPTIONS and s.now() - since > PREEMPTED_GIVE_UP_S:
                self._failed(ticket, exc)
            s.note(f"preempted {agent.name} on {ticket.replica} ({exc}); it starts over when KV frees up there")
        return Failure(preempt=victims, step_first=isinstance(call, MixedCall))  # a refused mixed step did not step

    def _failed(self, ticket: Ticket, exc: BaseException) -> Failure:
        """The agents of the call (or of its replica) failed: raise, naming them and their consumers;
        a call of runs that ended already fails nobody."""
        s = self.state
        sessions = set(ticket.call.sessions)
        if sessions and sessions <= s.dropped_sids:  # nobody waits for it
            return Failure()
        involved = [a.name for a in s.agents.values() if a.sid in sessions and a.replica == ticket.replica]
        failed = involved or [a.name for a in s.placed[ticket.replica] if a.state != AgentPhase.DONE]
        waiting = sorted({c for name in failed for c in s.agents[name].consumers})
        raise AgentFailedError(
            f"agent(s) {failed} on replica {ticket.replica} failed: {type(exc).__name__}: {exc}; "
            f"their consumers {waiting} were stopped", [*failed, *waiting]
        ) from exc

    def live_replicas(self, model: str) -> tuple[list[str], list[str], bool]:
        """The live replicas of `model`, the lost ones Ray restarted meanwhile (empty: they take
        agents again once the scheduler has forgotten what they held), and whether a lost one may
        still come back. One look: it never waits."""
        s = self.state
        lost = [r.name for r in s.replicas if r.model == model and r.name in s.dead and r.name not in self.gone]
        revived = []
        for rname in lost:
            back = s.backend.revived(rname, 0.0)
            if back is None:
                self.gone.add(rname)
            elif back:
                revived.append(rname)
        alive = [r.name for r in s.replicas if r.model == model and (r.name not in s.dead or r.name in revived)]
        return alive, revived, any(r not in self.gone and r not in revived for r in lost)

    def await_replica(self, agent: AgentState) -> bool:
        """`agent` found no live replica while one may come back: it waits (placed again on a later
        loop turn, `take_awaiting`) unless it has waited REVIVE_WAIT_S already (False)."""
        now = self.state.now()
        first = self.awaiting.get(agent.name)
        deadline = first[1] if first else now + REVIVE_WAIT_S
        if now >= deadline:
            self.awaiting.pop(agent.name, None)
            return False
        if first is None:
            self.state.note(f"agent {agent.name} waits for a replica of {agent.model} to come back")
        self.awaiting[agent.name] = (agent, deadline)
        return True

    def take_awaiting(self) -> list[AgentState]:
        """The agents waiting for a replica to come back that are still to place (dropped ones go)."""
        waiting = [agent for agent, _ in self.awaiting.values() if not agent.dropped and agent.state == AgentPhase.NEW]
        if len(waiting) != len(self.awaiting):
            self.awaiting = {a.name: self.awaiting[a.name] for a in waiting}
        return waiting
