"""Fault handling for the scheduler: dead replicas, failed transfers, failed agents.

A replica that dies loses its sessions; every agent it ran starts over from its prompt tokens
(its lineage) on a live replica, and consumers that had streamed tokens from it start over too;
once Ray has restarted it (empty), it takes agents again, and placement waits for it (bounded)
when no other replica of the model lives.
A failed transfer degrades to recomputing the prefix where it was going. A call refused for lack
of KV blocks preempts: the agents whose prompt it carried (for a decode step, the agent placed
last; for a shared prefix, the agents waiting for it) close their sessions and start over once
something of the run on that replica ends, or, when nothing of the run is left running (other runs
hold the KV), after a backoff. An agent that fails stops the run with an error naming it and the
consumers that will not run; the failed run then frees everything it holds on the replicas.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from aaflow.errors import AAFlowError, KVCapacityError, KVRefFreedError
from aaflow.runtime.calls import (Call, CloseCall, ComposeCall, ExposeCall, FreeCall, MaterializeCall, MixedCall,
                                  OpenCall, ReceiveCall, ReleaseCall)

if TYPE_CHECKING:
    from aaflow.runtime.backend import Ticket
    from aaflow.runtime.scheduler import Scheduler

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


class Recovery:
    """What the scheduler does when a replica dies or a call fails."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.preempted: dict[str, int] = {}  # agent -> times preempted
        self.gone: set[str] = set()  # dead replicas that will not be restarted
        self.preempted_since: dict[str, float] = {}  # agent -> when it was first preempted
        self.jitter = random.Random(scheduler.run_id)

    def cleanup(self) -> None:
        """After a failure: let the calls in flight end, then close every session still open, end
        every exposure and free every shared prefix (or composed prefix's part) the run holds on a
        live replica (bounded waits), so that a failed run leaves no KV behind for the runs that
        share its replicas."""
        s = self.scheduler
        calls = self._made_in_flight()
        calls += [(a.replica, CloseCall(a.sid)) for a in s.agents.values()
                 if a.replica is not None and a.replica not in s.dead and a.state != "done"]
        calls += [(move.source, move.release_call()) for move in s.prefixes.transferring.values()
                  if move.release_call() and move.source not in s.dead]  # an exposure holds the source's blocks
        calls += [(rname, FreeCall(ref_id)) for holders in s.prefixes.refs.values()
                  for rname, ref_id in holders.items() if rname not in s.dead]
        calls += [(key[-1], FreeCall(part.id)) for key, parts in s.prefixes.composing.items()
                  for part in parts if part is not None and key[-1] not in s.dead]
        s.prefixes.composing.clear()
        s.prefixes.transferring.clear()
        s.prefixes.refs.clear()
        s.prefixes.evicted.clear()
        tickets = [s.backend.submit(rname, call) for rname, call in calls]
        s.backend.wait(tickets, len(tickets), CLEANUP_TIMEOUT_S)

    def _made_in_flight(self) -> list[tuple[str, Call]]:
        """Wait (bounded) for the run's calls still in flight and name what their results hold on a
        replica (a new ref, an exposure), for cleanup to free it too."""
        s = self.scheduler
        pending = [t for t in s.queues.inflight if t.replica not in s.dead]
        frees = []
        for ticket in s.backend.wait(pending, len(pending), CLEANUP_TIMEOUT_S) if pending else []:
            try:
                value = s.backend.result(ticket)
            except Exception:  # noqa: BLE001 - a call that failed holds nothing
                continue
            call = ticket.call
            if isinstance(call, (MaterializeCall, ComposeCall, ReceiveCall)):
                record = value[0] if isinstance(call, ReceiveCall) else value  # RECEIVE: (record, stats)
                frees.append((ticket.replica, FreeCall(record.id)))
            elif isinstance(call, ExposeCall):  # (handle, shape, record)
                frees.append((ticket.replica, ReleaseCall(value[0], call.transport)))
        return frees

    def _restart(self, agent, gate: bool = False) -> None:
        """Start an agent over from its prompt (its lineage) on a live replica; `gate`: only once
        something on that replica has ended (it was preempted for lack of KV)."""
        s = self.scheduler
        if agent in s.decoding[agent.replica]:
            s.decoding[agent.replica].remove(agent)
        s.release_kv(agent)
        if gate:
            s.admission.gate(agent)
        agent.restart()
        s.open_if_ready(agent)

    def _restart_with_readers(self, agent, lost=(), gate: bool = False) -> None:
        """Restart `agent` and the consumers that streamed its tokens (they will be produced again)."""
        s = self.scheduler
        self._restart(agent, gate)
        for name in agent.consumers:
            consumer = s.agents[name]
            if consumer.state not in ("new", "admitting", "done") and consumer not in lost and consumer.fed:
                s.queues.call(consumer.replica, CloseCall(consumer.sid))
                self._restart(consumer)

    def backoff_s(self, agent) -> float:
        """How long a preempted agent waits before it is tried again while nothing of its run is in
        flight (the KV is held by other runs or pins): doubling from 50 ms up to 2 s, jittered so
        that runs waiting on each other do not retry in step."""
        base = min(MAX_BACKOFF_S, 0.05 * 2 ** max(0, self.preempted.get(agent.name, 1) - 1))
        return base * self.jitter.uniform(0.5, 1.5)

    def yield_kv(self, rname: str, keep) -> None:
        """Nothing of the run runs and `keep` waits for room on `rname` that other runs hold: the
        run's sessions and shared prefixes there give their KV back too (they start over later),
        so that runs holding KV while waiting for each other cannot wait forever."""
        s = self.scheduler
        for agent in [a for a in s.placed[rname] if a.state in ("open", "decoding") and a is not keep]:
            self.preempted[agent.name] = self.preempted.get(agent.name, 0) + 1
            s.events.append(f"{s.now():.2f}s preempted {agent.name} on {rname}: it holds KV while other runs "
                            "hold what its run needs; it starts over later")
            s.queues.call(rname, CloseCall(agent.sid))
            self._restart_with_readers(agent, gate=True)
        s.prefixes.drop_held(rname)

    def kv_short(self, ticket: Ticket, exc: KVCapacityError) -> None:
        """The replica refused a call for lack of KV blocks: preempt (see the module docstring)."""
        s = self.scheduler
        call = ticket.call
        if isinstance(call, MixedCall):  # its decode step did not run either: the next call steps alone
            s.queues.step_first.add(ticket.replica)
        on_replica = {a.sid: a for a in s.agents.values() if a.replica == ticket.replica and a.state != "done"}
        if call.kind.steps and not call.requests:
            decoding = [on_replica[sid] for sid in call.sessions if sid in on_replica]
            victims = [max(decoding, key=lambda a: a.order)] if decoding else []
        else:
            victims = [on_replica[r.sid] for r in call.requests if r.sid in on_replica]
            if isinstance(call, OpenCall) and call.sid in on_replica:
                victims = [on_replica[call.sid]]
            if isinstance(call, MaterializeCall):
                victims = s.prefixes.materialize_refused(ticket.replica, call.token_ids)
        if not victims:
            self.call_failed(ticket, exc, preempt=False)
            return
        for agent in victims:
            count = self.preempted[agent.name] = self.preempted.get(agent.name, 0) + 1
            since = self.preempted_since.setdefault(agent.name, s.now())
            if count > MAX_PREEMPTIONS and s.now() - since > PREEMPTED_GIVE_UP_S:
                self.call_failed(ticket, exc, preempt=False)
            s.events.append(f"{s.now():.2f}s preempted {agent.name} on {ticket.replica} ({exc}); "
                            "it starts over when KV frees up there")
            if agent.state != "opening":  # an agent waiting for a shared prefix has no session yet
                s.queues.call(agent.replica, CloseCall(agent.sid))
            self._restart_with_readers(agent, gate=True)

    def replica_died(self, rname: str) -> None:
        s = self.scheduler
        s.events.append(f"{s.now():.2f}s replica {rname} died; recomputing its agents elsewhere")
        s.dead.add(rname)
        s.queues.drop_replica(rname)
        s.prefixes.replica_died(rname)
        lost = [a for a in s.placed[rname] if a.state != "done"]
        for agent in lost:
            self._restart_with_readers(agent, lost)

    def live_replicas(self, model: str) -> list[str]:
        """The live replicas of `model`, taking back lost ones that were restarted meanwhile; when
        none lives, wait (up to REVIVE_WAIT_S) for one to come back."""
        s = self.scheduler
        lost = [r.name for r in s.replicas if r.model == model and r.name in s.dead and r.name not in self.gone]
        deadline = s.now() + REVIVE_WAIT_S
        timeout = 0.0  # a first look without waiting
        while True:
            for rname in list(lost):
                back = s.backend.revived(rname, timeout / max(1, len(lost)))
                if back is None:
                    self.gone.add(rname)
                if back is not False:
                    lost.remove(rname)
                if back:
                    self._revived(rname)
            alive = [r.name for r in s.replicas if r.model == model and r.name not in s.dead]
            if alive or not lost or s.now() >= deadline:
                return alive
            timeout = 1.0

    def _revived(self, rname: str) -> None:
        """A lost replica was restarted (empty): it takes agents again; its agents were restarted
        elsewhere when it died."""
        s = self.scheduler
        s.events.append(f"{s.now():.2f}s replica {rname} is back; placing agents on it again")
        s.dead.discard(rname)
        s.placed[rname] = [a for a in s.placed[rname] if a.state == "done"]
        s.load[rname], s.decoding[rname] = 0, []
        for name in [n for n, r in s.admission.gated.items() if r == rname]:
            del s.admission.gated[name]

    def free_found_nothing(self, rname: str) -> None:
        """A free answered KVRefFreedError: the replica died and Ray restarted it since the ref was
        made, and the ref went with it; there is nothing left to free."""
        s = self.scheduler
        s.events.append(f"{s.now():.2f}s {rname} was restarted: no prefix left to free")

    def call_failed(self, ticket: Ticket, exc: BaseException, preempt: bool = True) -> None:
        s = self.scheduler
        if isinstance(ticket.call, FreeCall) and isinstance(exc, KVRefFreedError):
            self.free_found_nothing(ticket.replica)
            return
        if preempt and isinstance(exc, KVCapacityError) and not ticket.call.kind.transfers:
            self.kv_short(ticket, exc)
            return
        if ticket.call.kind.transfers:  # fall back to recomputing the prefix where it was going
            s.events.append(f"{s.now():.2f}s transfer via {ticket.replica} failed ({exc}); recomputing instead")
            s.prefixes.transfer_failed()
            return
        sessions = set(ticket.call.sessions)
        if sessions and sessions <= s.dropped_sids:  # a call of runs that ended already: nobody waits for it
            return
        involved = [a.name for a in s.agents.values() if a.sid in sessions and a.replica == ticket.replica]
        failed = involved or [a.name for a in s.placed[ticket.replica] if a.state != "done"]
        waiting = sorted({c for name in failed for c in s.agents[name].consumers})
        raise AgentFailedError(
            f"agent(s) {failed} on replica {ticket.replica} failed: {type(exc).__name__}: {exc}; "
            f"their consumers {waiting} were stopped", [*failed, *waiting]
        ) from exc
