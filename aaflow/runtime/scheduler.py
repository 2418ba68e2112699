"""The scheduler: runs agents on replicas, one short replica call at a time.

What each strategy does on an agent's incoming edges is written in `aaflow.common.strategies`; explicit
KV operator nodes (see `kvops`) add prefix sharing and a replica choice on top.

It is plain code that owns its state (`SchedulerState`) and drives replicas through a `Backend`:
on Ray (`aaflow.cluster.ray_backend`) it runs workflows; on the simulated clock (`sim_backend`) it
predicts them. Its parts own their own state, read the scheduler's and decide; it acts
(`lifecycle`): `Placement`, `Admission`, `CallQueues` (per-replica queues, packing, mixed steps,
lending), `PrefixSharing`, `Recovery`.
"""

from __future__ import annotations

import uuid
from enum import Enum

from aaflow.runtime.admission import Admission
from aaflow.runtime.agent_state import AgentPhase, AgentState
from aaflow.runtime.backend import Backend, ReplicaLostError, Ticket
from aaflow.runtime.call_queues import CallQueues
from aaflow.runtime.calls import CloseCall
from aaflow.runtime.lifecycle import AgentLifecycle
from aaflow.runtime.placement import Placement
from aaflow.runtime.prefix_sharing import PrefixSharing
from aaflow.runtime.recovery import AgentFailedError, Recovery
from aaflow.runtime.scheduler_state import SchedulerState

AWAIT_POLL_S = 0.2  # with nothing in flight but agents waiting for a replica to come back: look again this often


class Turn(Enum):
    """What one turn of the loop did (`Scheduler.turn`)."""

    RAN = "ran"  # a call ended and was handed on
    TIMED_OUT = "timed out"  # calls are in flight; none ended within the wait
    AWAITING = "awaiting"  # nothing in flight: agents wait for a replica to come back
    STALLED = "stalled"  # nothing in flight, nothing can start, no agent waits for a replica


class Scheduler(AgentLifecycle):
    """Runs agents to their end (`run`), or serves runs that join it (`add`, `forget`): the
    agents' lifecycle (`AgentLifecycle`), the parts that decide it, and the loop."""

    def __init__(self, agents: dict[str, AgentState], backend: Backend, eos: dict[str, set[int]],
                 chunk_tokens: int = 16, call_timeout_s: float = 300.0, transport: str | None = None,
                 lend_cores: bool = True, on_token=None, on_done=None) -> None:
        self.backend = backend
        self.on_token, self.on_done = on_token, on_done  # (agent name, token id) / (agent name): streaming
        self.chunk_tokens, self.call_timeout_s = max(1, chunk_tokens), call_timeout_s
        st = self.state = SchedulerState(backend, eos)
        self.placements = 0
        self.run_id = uuid.uuid4().hex[:12]  # session names are unique across concurrent runs on shared replicas
        self.unfinished = 0
        self.placement = Placement()
        self.queues = CallQueues(st, lend_cores, self.on_steps, lambda: self.prefixes.waiting_agents(), self._lends)
        self.admission = Admission(self.state.replicas, self.state.agents, self.state.dead,
                                   lambda key, replica: self.prefixes.resident(key, replica))
        self.prefixes = PrefixSharing(st, self.queues, transport, self.opened)
        self.recovery = Recovery(st, self.run_id)
        self._register(agents)

    def _register(self, agents: dict[str, AgentState]) -> None:
        """Take `agents` (names unique across everything this scheduler runs) into its state."""
        self.state.agents.update(agents)
        for a in agents.values():
            self.state.readers[a.name] = [self.state.agents[c] for c in a.consumers]
            self.state.streaming_readers[a.name] = [c for c in self.state.readers[a.name] if c.streams]
        self.unfinished += len(agents)

    def _lends(self, sessions: list[str]) -> bool:
        """Whether every run of `sessions` lets its long prefills borrow idle replicas' threads (for
        a call of no session, a shared prefix's materialize: every run with an agent still to end)."""
        wanted = set(sessions)
        return all(a.options.lend_cores for a in self.state.agents.values()
                   if a.options and (a.sid in wanted if wanted else a.state != AgentPhase.DONE))

    def add(self, agents: dict[str, AgentState]) -> None:
        """Agents of another run join the running scheduler: they are placed, batched and admitted
        with everything it runs already (`aaflow.runtime.service`)."""
        self._register(agents)
        for agent in agents.values():
            self.open_if_ready(agent)

    def forget(self, agents: list[AgentState]) -> None:
        """Drop finished (or dropped) agents from the scheduler's state once their run has ended."""
        for a in agents:
            self.state.agents.pop(a.name, None)
            self.state.readers.pop(a.name, None)
            self.state.streaming_readers.pop(a.name, None)
            self.recovery.forget(a.name)
        for name, placed in self.state.placed.items():
            self.state.placed[name] = [a for a in placed if a not in agents]

    def drop(self, agents: list[AgentState]) -> None:
        """End `agents` (one run's: it failed, was cancelled or passed its deadline) without their
        output: each gives its KV reservation back, leaves the decode batch, the admission queue
        and the prefix waiters, loses its queued prompt segments, and has its session closed after
        whatever call of it is in flight (a replica runs its calls in order). Calls of it that end
        later find it dropped and do nothing; the other runs' agents are not touched."""
        for agent in agents:
            if agent.state == AgentPhase.DONE:
                continue
            replica = agent.replica
            if replica is not None:
                if agent in self.state.decoding[replica]:
                    self.state.decoding[replica].remove(agent)
                if agent in self.state.placed[replica]:  # not one waiting for its replica to come back
                    self.state.load[replica] -= 1
                self.queues.discard_prefills(replica, agent.sid)
                if agent.state not in (AgentPhase.NEW, AgentPhase.ADMITTING) and replica not in self.state.dead:
                    self.queues.call(replica, CloseCall(agent.sid))
            self.release_kv(agent)
            self.admission.drop(agent)
            self.prefixes.stop_waiting(agent)
            self.state.fresh_sids.discard(agent.sid)
            self.state.dropped_sids.add(agent.sid)
            agent.state, agent.dropped, agent.busy = AgentPhase.DONE, True, False
            agent.end_s = self.now()
            self.unfinished -= 1

    def force_admission(self) -> bool:
        """Nothing runs: open the first waiting agent anyway (preemption handles a real shortage),
        one preempted while others hold the KV after they yield it. False when nobody waits."""
        first = self.admission.head()
        if first is None:
            return False
        if first.name in self.admission.gated:
            self.preempt(self.recovery.yield_victims(first.replica, keep=first))
            self.prefixes.drop_held(first.replica)
            self.backend.pause(self.recovery.backoff_s(first))
            if not self.admission.is_waiting(first):  # admitted meanwhile
                return True
        self.admission.force(first)
        self.opened_admitted(first)
        return True

    def run(self) -> None:
        """Run every agent to its end, then what is still queued; frees every shared prefix.
        Raises AgentFailedError naming the agents that failed and the consumers stopped."""
        try:
            self._loop()
        except BaseException:
            self.cleanup()
            raise
        self.prefixes.free_all()
        self.queues.drain(self.call_timeout_s)

    def cleanup(self) -> None:
        """After a failure: free every session and shared prefix the run holds (`Recovery.cleanup`)."""
        self.recovery.cleanup(list(self.queues.inflight), self.prefixes.let_go())

    def dispose(self) -> None:
        """Drop the links to its parts, which point back at it: a finished scheduler is then freed
        by reference counting, not left to the cyclic collector (the planner runs dozens)."""
        self.queues = self.admission = self.prefixes = self.recovery = None

    def _loop(self) -> None:
        for agent in self.state.agents.values():
            self.open_if_ready(agent)
        while self.unfinished:
            turn = self.turn(self.call_timeout_s)
            if turn is Turn.STALLED:
                stuck = [a.name for a in self.state.agents.values() if a.state != AgentPhase.DONE]
                raise AgentFailedError(f"workflow cannot progress; agents {stuck} wait for inputs that never come",
                                       stuck)
            if turn is Turn.AWAITING:
                self.backend.pause(AWAIT_POLL_S)
            elif turn is Turn.TIMED_OUT:
                names = sorted(self.busy_replicas())
                raise AgentFailedError(f"replicas {names} did not answer within {self.call_timeout_s:.0f} s",
                                       [a.name for a in self.state.agents.values() if a.state != AgentPhase.DONE])

    def turn(self, timeout_s: float) -> Turn:
        """One turn of the loop, the same for one run (`run`), a cluster's loop (`RunService`) and a
        predicted load (`planning.load`): start what may run, wait up to `timeout_s` for one call
        in flight to end and hand its value on."""
        if not self.launch():
            return Turn.STALLED
        if not self.queues.inflight:
            return Turn.AWAITING
        ready = self.backend.wait(list(self.queues.inflight), 1, timeout_s)
        if not ready:
            return Turn.TIMED_OUT
        self.process(ready[0])
        return Turn.RAN

    def busy_replicas(self) -> set[str]:
        """Replicas with a call in flight."""
        return {t.replica for t in self.queues.inflight}

    def has_queued_calls(self) -> bool:
        """A live replica has calls queued that are not in flight yet."""
        return any(q for name, q in self.queues.queues.items() if name not in self.state.dead)

    def awaiting_replica(self) -> bool:
        """Agents wait for a replica of their model to come back."""
        return bool(self.recovery.awaiting)

    def after_queued_calls(self, tag: str, then) -> set[str]:
        """Queue a no-op call (closing session `tag`, which holds nothing) on every live replica,
        behind the calls queued there; `then(replica)` runs as each has ended. The replicas."""
        replicas = {r for r in self.queues.replicas if r not in self.state.dead}
        for replica in replicas:
            self.queues.call(replica, CloseCall(tag), then=lambda _, replica=replica: then(replica))
        return replicas

    @property
    def events(self) -> list[str]:
        """What the loop did, in order (every run's)."""
        return self.state.events

    def prefix_decisions(self) -> dict[str, dict]:
        """How replicas got the shared prefixes they lacked, per kind, since the scheduler began
        (`aaflow.runtime.prefix_decisions`)."""
        return self.prefixes.decisions.snapshot()

    def is_dead(self, replica: str) -> bool:
        return replica in self.state.dead

    def room_wanted(self) -> bool:
        """Some agent waits for KV room to open on its replica."""
        return any(self.admission.waiting.values())

    def held_prefixes(self) -> set:
        """The keys of the shared prefixes held on some replica."""
        return set(self.prefixes.refs)

    def free_prefixes(self, keys: set) -> int:
        """Free the shared prefixes of `keys` no unfinished agent reads (`PrefixSharing.free_unread`)."""
        return self.prefixes.free_unread(keys)

    def forget_prefixes(self, keep: set) -> None:
        """Free every shared prefix but those of `keep` (nothing pending reads them)."""
        for key in self.held_prefixes() - keep:
            self.prefixes.forget(key)

    def take_shared_computed(self, names) -> int:
        """The prefix tokens shared prefixes computed for the agents `names` (counted once, here)."""
        return sum(self.prefixes.computed_for.pop(name, 0) for name in names)

    def launch(self) -> bool:
        """Start what may run; False when nothing is in flight, nothing can be started and no agent
        waits for a replica to come back (those are placed again first, each time)."""
        for agent in self.recovery.take_awaiting():
            self.open(agent)
        while True:
            self.queues.launch()
            if self.queues.inflight or self.recovery.awaiting:
                return True
            if not self.force_admission():
                return False

    def process(self, ticket: Ticket) -> None:
        """Hand an ended call's value to what waits for it, or its failure to `Recovery`."""
        then = self.queues.finish(ticket)
        try:
            value = self.backend.result(ticket)
        except ReplicaLostError:
            self.replica_died(ticket.replica)
        except Exception as exc:  # noqa: BLE001 - named below
            cause = getattr(exc, "cause", None) or exc
            partial = getattr(cause, "partial_steps", None)
            if partial is not None:  # a group of steps failed after some ran: take their tokens first
                then(partial)
            self.failed(ticket, cause)
        else:
            then(value)

    def failed(self, ticket: Ticket, exc: BaseException) -> None:
        """Carry out what `Recovery` decides about a failed call (it raises for failed agents)."""
        failure = self.recovery.failure(ticket, exc, self.prefixes.materialize_refused)
        if failure.step_first:
            self.queues.step_first.add(ticket.replica)
        if failure.recompute_transfers:
            self.prefixes.transfer_failed()
        self.preempt(failure.preempt)

    def replica_died(self, rname: str) -> None:
        """Its sessions are lost: every agent it ran starts over elsewhere (`Recovery`, module doc)."""
        self.state.note(f"replica {rname} died; recomputing its agents elsewhere")
        self.state.dead.add(rname)
        self.queues.drop_replica(rname)
        self.prefixes.replica_died(rname)
        lost = [a for a in self.state.placed[rname] if a.state != AgentPhase.DONE]
        for agent in lost:
            self.restart_with_readers(agent, lost)
