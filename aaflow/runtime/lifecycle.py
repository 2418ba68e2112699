"""An agent's life in the scheduler: placed, admitted, opened (with a shared prefix or not), fed
its prompt segments as they become position-stable, decoding, closed; or started over from its
prompt (its lineage) when it was preempted or its replica died.

`Scheduler` (aaflow.runtime.scheduler) builds on this with the parts it owns and the loop that
drives them.
"""

from __future__ import annotations

from bisect import insort
from typing import Callable

from aaflow.runtime.admission import Admission
from aaflow.runtime.agent_state import AgentPhase, AgentState
from aaflow.runtime.call_queues import CallQueues
from aaflow.runtime.calls import CloseCall, OpenCall, PrefillCall
from aaflow.runtime.feeding import consume, feedable
from aaflow.runtime.placement import Placement
from aaflow.runtime.prefix_sharing import PrefixSharing
from aaflow.runtime.recovery import AgentFailedError, Recovery
from aaflow.runtime.replies import PrefillReply
from aaflow.runtime.scheduler_state import SchedulerState
from aaflow.common.strategies import SHARES_PREFIX, STREAMS, TEXT_NOCACHE


class AgentLifecycle:
    """What happens to one agent, step by step; each method acts on the parts' decisions."""

    state: SchedulerState
    agents: dict[str, AgentState]
    placed: dict[str, list[AgentState]]
    decoding: dict[str, list[AgentState]]
    load: dict[str, int]
    readers: dict[str, list[AgentState]]
    streaming_readers: dict[str, list[AgentState]]
    fresh_sids: set[str]
    placement: Placement
    queues: CallQueues
    admission: Admission
    prefixes: PrefixSharing
    recovery: Recovery
    placements: int
    unfinished: int
    run_id: str
    chunk_tokens: int
    on_token: Callable[[str, int], None] | None  # (agent name, token id): streaming
    on_done: Callable[[str], None] | None  # (agent name)

    def now(self) -> float:
        return self.state.now()

    def place(self, agent: AgentState) -> bool:
        """Put `agent` on the replica `Placement` chooses; False when none lives yet but one may
        come back (the agent waits for it: `Recovery.await_replica`)."""
        alive, revived, pending = self.recovery.live_replicas(agent.model)
        for rname in revived:
            self.revived(rname)
        if not alive and pending and self.recovery.await_replica(agent):
            return False
        if not alive:
            raise AgentFailedError(f"agent {agent.name!r}: no live replica serves {agent.model!r}", [agent.name])
        self.recovery.awaiting.pop(agent.name, None)
        best = self.placement.choose(agent, alive, self.state.load, self.prefixes.refs.get(agent.prefix_key, {}),
                                     self.admission.fits)
        if agent.replica is not None and agent in self.state.placed[agent.replica]:
            self.state.placed[agent.replica].remove(agent)
            self.state.load[agent.replica] -= 1
        self.state.placed[best].append(agent)
        self.state.load[best] += 1
        agent.order, self.placements = self.placements, self.placements + 1
        agent.replica, agent.result.replica = best, best
        agent.sid = f"{self.run_id}/{agent.name}#{agent.result.restarts}"
        agent.result.strategy = agent.strategy
        agent.start_s = self.now()
        return True

    def revived(self, rname: str) -> None:
        """A lost replica was restarted (empty): it takes agents again; its agents were restarted
        elsewhere when it died."""
        self.state.note(f"replica {rname} is back; placing agents on it again")
        self.state.dead.discard(rname)
        self.state.placed[rname] = [a for a in self.state.placed[rname] if a.state == AgentPhase.DONE]
        self.state.load[rname], self.state.decoding[rname] = 0, []
        self.admission.ungate(rname)

    def open(self, agent: AgentState) -> None:
        if self.place(agent) and self.admission.admit(agent):
            self.opened_admitted(agent)

    def release_kv(self, agent: AgentState) -> None:
        """`agent` ended or starts over: its KV reservation goes; open whoever admission admits now."""
        for admitted in self.admission.release(agent):
            self.opened_admitted(admitted)

    def opened_admitted(self, agent: AgentState) -> None:
        """Its KV has room on its replica: open its session (on a fork of its shared prefix or not)."""
        agent.state = AgentPhase.OPENING
        if agent.shares_prefix:
            self.prefixes.fork_into(agent, agent.prefix_key)
            return
        at, sid = agent.replica, agent.sid
        self.queues.call(at, OpenCall(sid), then=lambda _: self.opened(agent, at, sid))

    def open_if_ready(self, agent: AgentState) -> None:
        """Streaming and prefix-sharing agents open at once; text / recompute once their inputs are done."""
        if agent.strategy in STREAMS + SHARES_PREFIX or self.inputs_done(agent):
            self.open(agent)

    def opened(self, agent: AgentState, replica: str, sid: str, prefix_len: int = 0) -> None:
        """Its session `sid` is open on `replica` (on a fork of `prefix_len` tokens of shared prefix,
        or empty)."""
        if agent.dropped or agent.sid != sid:  # its run ended, or it started over, while the session opened
            self.queues.call(replica, CloseCall(sid))
            return
        agent.state = AgentPhase.OPEN
        if prefix_len:
            agent.fed, agent.seg, agent.offset = prefix_len, 1, 0
            agent.result.prefill_reused += prefix_len
            agent.result.prompt_tokens += prefix_len
            if agent.evicts_prefix:
                self.prefixes.evict_if_forked(agent.prefix_key)
        self.advance(agent)

    def inputs_done(self, agent: AgentState) -> bool:
        for name in agent.upstream:  # a loop, not all(): this runs for every token of every upstream
            if self.state.agents[name].state != AgentPhase.DONE:
                return False
        return True

    def advance(self, agent: AgentState) -> None:
        if agent.state != AgentPhase.OPEN or agent.busy:
            return
        if not agent.streams and not self.inputs_done(agent):
            return
        pieces, count, complete, streamed = feedable(self.state.agents, agent)
        chunk = agent.options.chunk_tokens if agent.options else self.chunk_tokens
        if not complete and (not count or (agent.fed > 0 and count < chunk)):
            return  # wait for a full chunk (the static part goes at once)
        ids: list[int] = []
        for tokens, start in pieces:
            ids.extend(tokens[start:])
        agent.busy, agent.fresh = True, agent.fed == 0
        if agent.fresh:
            self.state.fresh_sids.add(agent.sid)
        consume(self.state.agents, agent, len(ids))
        agent.result.streamed_tokens += streamed
        agent.result.prompt_tokens += len(ids)
        call = PrefillCall(agent.sid, ids, agent.sampling if complete else None, agent.strategy != TEXT_NOCACHE)
        self.queues.call(agent.replica, call, then=lambda out, sid=agent.sid: self.prefilled(agent, sid, out))

    def prefilled(self, agent: AgentState, sid: str, out: PrefillReply) -> None:
        """A prompt segment of session `sid` ran (`out`: tokens computed and reused, maybe the first token)."""
        if agent.sid != sid:  # it started over meanwhile: the answer is of a session closed since
            return
        agent.busy = False
        if agent.dropped:  # its run ended while the segment ran: its session is closed after this call
            return
        self.state.fresh_sids.discard(agent.sid)
        agent.result.prefill_computed += out.computed
        agent.result.prefill_reused += out.reused
        if agent.fresh:
            agent.prefix_via = agent.prefix_via or ("reuse" if out.reused else "recompute")
        if out.token is not None:
            agent.state = AgentPhase.DECODING
            insort(self.state.decoding[agent.replica], agent, key=lambda a: a.order)
            self.token(agent, out.token)
        else:
            self.advance(agent)

    def on_steps(self, decoding: list[AgentState], tokens: list[list[int]], ends: list[float]) -> None:
        """Decode steps ended: each agent's tokens, and each step's end (seconds into the call),
        which dates the tokens back from now."""
        now = self.now()
        for i, end in enumerate(ends):
            t = now - (ends[-1] - end)
            for agent, row in zip(decoding, tokens):
                if i < len(row) and agent.state == AgentPhase.DECODING:
                    self.token(agent, row[i], t)

    def token(self, agent: AgentState, token: int, t: float | None = None) -> None:
        """`agent` decoded `token` (at `t`, default now)."""
        t = self.now() if t is None else t
        r = agent.result
        if r.first_token_s is None:
            r.first_token_s = t
        r.last_token_s, r.decoded = t, r.decoded + 1
        is_eos = not agent.ignore_eos and token in self.state.eos[agent.model]
        if not is_eos:
            agent.output.append(token)
            if self.on_token is not None:
                self.on_token(agent.name, token)
        if not is_eos and r.decoded < agent.max_tokens:
            for consumer in self.state.streaming_readers[agent.name]:  # the others wait for it to finish
                self.advance(consumer)
            return
        agent.state, agent.end_s = AgentPhase.DONE, t
        self.unfinished -= 1
        self.state.load[agent.replica] -= 1
        self.state.decoding[agent.replica].remove(agent)
        self.queues.call(agent.replica, CloseCall(agent.sid))
        for consumer in self.state.readers[agent.name]:  # before its release: they wait for room with its prefix held
            if consumer.state == AgentPhase.NEW and self.inputs_done(consumer):
                self.open(consumer)
            else:
                self.advance(consumer)
        self.release_kv(agent)
        if self.on_done is not None:
            self.on_done(agent.name)

    def restart(self, agent: AgentState, gate: bool = False) -> None:
        """Start an agent over from its prompt (its lineage) on a live replica; `gate`: only once
        something on that replica has ended (it was preempted for lack of KV)."""
        if agent in self.state.decoding[agent.replica]:
            self.state.decoding[agent.replica].remove(agent)
        self.release_kv(agent)
        if gate:
            self.admission.gate(agent)
        agent.restart()
        self.open_if_ready(agent)

    def restart_with_readers(self, agent: AgentState, lost=(), gate: bool = False) -> None:
        """Restart `agent` and the consumers that streamed its tokens (they will be produced again),
        but those in `lost` (restarted anyway)."""
        self.restart(agent, gate)
        for name in agent.consumers:
            consumer = self.state.agents[name]
            if consumer.state not in (AgentPhase.NEW, AgentPhase.ADMITTING, AgentPhase.DONE) and consumer not in lost and consumer.fed:
                self.queues.call(consumer.replica, CloseCall(consumer.sid))
                self.restart(consumer)

    def preempt(self, agents: list[AgentState]) -> None:
        """Close the sessions of `agents` (those that have one) and start them over once KV frees
        up on their replica."""
        for agent in agents:
            if agent.state != AgentPhase.OPENING:  # an agent waiting for a shared prefix has no session yet
                self.queues.call(agent.replica, CloseCall(agent.sid))
            self.restart_with_readers(agent, gate=True)
