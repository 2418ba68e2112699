"""The scheduler's replica calls: one FIFO queue per replica, one call in flight per replica (or
one run of bookkeeping calls).

A replica with decoding sessions alternates batched decode steps with its queued calls; the
bookkeeping calls at the head of its queue (opens, closes, frees: a millisecond each) go between
two steps without taking a turn, since a burst of them, as when many agents end at once, would
otherwise hold back the prompt segments queued behind them one step each; and the whole run of them
at the head goes at once (the replica runs its calls in the order they were sent), so that their
round trips overlap. Queued prompt segments of several agents go as one packed
call (`packing`), and with the decode step in one forward pass when the replica also decodes (a
mixed step); a mixed step refused for KV is followed by a step of its decoding agents alone. With
nothing queued, a replica may run several decode steps in one call (`step_groups`). A long
prefill sent while other built-in replicas of its node idle runs on their threads too
(`core_lending`).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from aaflow.common.errors import KVRefFreedError
from aaflow.runtime.agent_state import AgentPhase, AgentState
from aaflow.runtime.backend import ReplicaLostError, Ticket
from aaflow.runtime.calls import Call, CallKind, MixedCall, PrefillCall, StepCall, StepsCall
from aaflow.runtime.core_lending import LEND_MIN_TOKENS, lent_threads
from aaflow.runtime.packing import Queued, pack_prefills
from aaflow.runtime.replies import MixedReply
from aaflow.runtime.scheduler_state import SchedulerState
from aaflow.runtime.step_groups import steps_per_call, stops

Decoded = Callable[[list[AgentState], list[list[int]], list[float]], None]  # see CallQueues


class CallQueues:
    """Owns the per-replica queues and the calls in flight; launches what may run. It reads the
    scheduler's `state`; the tokens of the decode steps it starts go to `decoded(agents, each
    agent's tokens, each step's end in seconds into the call)`; `waiting_for_prefix()` names (ids)
    the agents waiting for a shared prefix to arrive; `lends(sessions)`: whether the runs of those
    sessions let a long prefill of theirs borrow idle replicas' threads."""

    def __init__(self, state: SchedulerState, lend_cores: bool, decoded: Decoded,
                 waiting_for_prefix: Callable[[], set[int]] = set,
                 lends: Callable[[list[str]], bool] = lambda sessions: True) -> None:
        self.state, self.backend, self.lend_cores, self.lends = state, state.backend, lend_cores, lends
        self.decoded, self.waiting_for_prefix = decoded, waiting_for_prefix
        self.replicas = {r.name: r for r in state.replicas}
        self.queues: dict[str, deque[Queued]] = {name: deque() for name in self.replicas}
        self.inflight: dict[Ticket, Callable] = {}  # ticket -> what to do with its value
        self.running: dict[str, set[Ticket]] = {}  # replica -> its calls in flight
        self.last_kind: dict[str, CallKind] = {}
        self.step_first: set[str] = set()  # replicas whose mixed step was refused: they step alone next

    def now(self) -> float:
        """The backend's clock."""
        return self.state.now()

    def call(self, replica: str, call: Call, then: Callable | None = None) -> None:
        """Queue `call` on `replica`; `then(value)` runs when it has ended."""
        self.queues[replica].append((call, then))

    def drain(self, timeout_s: float) -> None:
        """Run what is still queued once every agent has ended (session closes, releases, the shared
        prefixes' frees), so that no KV outlives the run; each round waits for every call in flight."""
        dead = set(self.state.dead)  # those found dead meanwhile are named in the log
        while any(self.queues[r] for r in self.queues if r not in dead) or self.inflight:
            self.launch()
            ready = self.backend.wait(list(self.inflight), len(self.inflight), timeout_s)
            if not ready:
                break
            for ticket in ready:
                then = self.finish(ticket)
                try:
                    then(self.backend.result(ticket))
                except ReplicaLostError:  # died after its agents finished: nothing to free
                    dead.add(ticket.replica)
                    self.state.note(f"replica {ticket.replica} died after its agents ended")
                except KVRefFreedError:
                    self.state.note(f"{ticket.replica} was restarted: no prefix left to free")

    def launch(self) -> None:
        """Start a call on every live replica that has none in flight and something to do."""
        dead = self.state.dead
        for name in self.replicas:
            if name in self.running or name in dead:
                continue
            decoding = list(self.state.decoding[name])
            queue = self.queues[name]
            if queue and queue[0][0].kind.bookkeeping:  # not a turn: the next launch still alternates
                while queue and queue[0][0].kind.bookkeeping:
                    call, then = queue.popleft()
                    self._start(name, call, then)
            elif decoding and name in self.step_first:  # the prompt that was refused does not hold decoding back
                self.step_first.discard(name)
                self._step(name, decoding, 1)
            elif decoding and queue and queue[0][0].kind is CallKind.PREFILL:  # decode and prefill in one pass
                pack, answer = self._pack(name, always=True)
                call = MixedCall([a.sid for a in decoding], pack.requests)
                self._start(name, call, lambda out, ds=decoding, c=call, a=answer: self._on_mixed(ds, c.sids, a, out))
            elif decoding and (not queue or not self.last_kind.get(name, CallKind.OPEN).steps):
                steps = 1 if queue else steps_per_call(decoding, self.state.streaming_readers)
                self._step(name, decoding, steps)
            elif queue:
                call, then = self._pack(name) if queue[0][0].kind is CallKind.PREFILL else queue.popleft()
                self._start(name, self._lend(name, call), then)

    def _step(self, name: str, decoding: list, steps: int) -> None:
        """One decode step of `decoding`, or a group of `steps` in one call."""
        sids = [a.sid for a in decoding]
        if steps == 1:
            self._start(name, StepCall(sids), lambda tokens: self._stepped(decoding, sids, [[t] for t in tokens], [0.0]))
        else:
            call = StepsCall(sids, steps, stops(decoding, self.state.eos))
            self._start(name, call, lambda out: self._stepped(decoding, sids, out.tokens, out.ends_s))

    def _stepped(self, decoding: list[AgentState], sids: list[str], tokens: list[list[int]], ends: list[float]) -> None:
        """Steps of sessions `sids` ended: their tokens go on, but those of agents that started over
        meanwhile (the session is not theirs any more)."""
        current = [row if a.sid == sid else [] for a, sid, row in zip(decoding, sids, tokens)]
        self.decoded(decoding, current, ends)

    def _start(self, name: str, call: Call, then: Callable | None) -> None:
        ticket = self.backend.submit(name, call)
        if isinstance(then, Timed):
            then.started_s = self.now()
        self.inflight[ticket] = then
        self.running.setdefault(name, set()).add(ticket)
        if not call.kind.bookkeeping:
            self.last_kind[name] = call.kind

    def finish(self, ticket: Ticket) -> Callable:
        """Forget an ended call; returns its callback (a no-op where it had none)."""
        running = self.running.get(ticket.replica)
        if running is not None:
            running.discard(ticket)
            if not running:
                del self.running[ticket.replica]
        return self.inflight.pop(ticket) or _ignore

    def discard_prefills(self, replica: str, sid: str) -> None:
        """Forget the prompt segments queued on `replica` for session `sid` (its run ended)."""
        queue = self.queues.get(replica)
        if queue:
            kept = [q for q in queue if not (isinstance(q[0], PrefillCall) and q[0].sid == sid)]
            queue.clear()
            queue.extend(kept)

    def drop_replica(self, name: str) -> None:
        """A replica died: forget its queue and its calls in flight."""
        self.queues[name].clear()
        for ticket in self.running.pop(name, ()):
            self.inflight.pop(ticket, None)

    def _lend(self, name: str, call: Call) -> Call:
        """A long prefill borrows the threads of the idle replicas of its node."""
        tokens = call.tokens if self.lend_cores and call.kind.prefills else 0
        if tokens < LEND_MIN_TOKENS or not self.lends(call.sessions):
            return call
        info = {r.name: {"node": r.node, "threads": r.threads} for r in self.replicas.values()}
        lent = lent_threads(self.replicas[name], list(self.replicas.values()), info, self._idle_replicas())
        if not lent:
            return call
        own = self.replicas[name].threads
        self.state.note(f"{name} prefills {tokens} tokens on {own + lent} threads ({lent} lent by idle replicas)")
        return call.with_threads(own + lent)

    def _idle_replicas(self) -> set[str]:
        """Replicas with no call in flight (those launched so far included) or queued, whose
        unfinished agents all wait for a shared prefix: nothing can reach them during a prefill."""
        waiting = self.waiting_for_prefix()
        return {name for name in self.replicas
                if name not in self.running and name not in self.state.dead and not self.queues[name]
                and all(a.state == AgentPhase.DONE or id(a) in waiting for a in self.state.placed[name])}

    def _on_mixed(self, decoding: list, sids: list[str], answer_prefills, out: MixedReply) -> None:
        self._stepped(decoding, sids, [[t] for t in out.tokens], [0.0])
        answer_prefills(out.prefills)

    def _pack(self, name: str, always: bool = False) -> Queued:
        """The queue's first call (a prompt segment) with the others that pack with it; with
        `always`, as a PACK call even when it goes alone."""
        queue = self.queues[name]
        return pack_prefills(queue.popleft(), queue, self.state.fresh_sids, always)


def _ignore(_value) -> None:
    return None


class Timed:
    """A call's callback that is told when its call was launched: the call's own time is then
    `ran_s()` when the callback runs, however long it queued before."""

    def __init__(self, then: Callable, clock: Callable[[], float]) -> None:
        self.then, self.clock, self.started_s = then, clock, None

    def __call__(self, value):
        return self.then(value)

    def ran_s(self) -> float:
        return self.clock() - self.started_s if self.started_s is not None else 0.0
