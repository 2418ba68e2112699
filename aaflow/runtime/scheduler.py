"""The scheduler: runs agents on replicas, one short replica call at a time.

What each strategy does on an agent's incoming edges is written in `aaflow.strategies`; explicit
KV operator nodes (see `kvops`) add prefix sharing and a replica choice on top.

It is plain code that owns its state and drives replicas through a `Backend`: on Ray
(`cluster.ray_backend`) it runs workflows; on the simulated clock (`sim_backend`) it predicts
them. Its parts decide and it acts: `Placement`, `Admission`, `CallQueues` (per-replica queues,
packing, mixed steps, lending), `PrefixSharing`, `Recovery`.
"""

from __future__ import annotations

import uuid
from bisect import insort

from aaflow.runtime.admission import Admission
from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.backend import Backend, ReplicaLostError
from aaflow.runtime.call_queues import CallQueues
from aaflow.runtime.calls import CloseCall, OpenCall, PrefillCall
from aaflow.runtime.placement import Placement
from aaflow.runtime.prefix_sharing import PrefixSharing
from aaflow.runtime.feeding import consume, feedable
from aaflow.runtime.recovery import AgentFailedError, Recovery
from aaflow.strategies import SHARES_PREFIX, STREAMS, TEXT_NOCACHE


class Scheduler:
    """Agent lifecycle: placement, opening (with a shared prefix or not), feeding prompt segments
    as they become position-stable, decoding, closing; `run` drives it to the end."""

    def __init__(self, agents: dict[str, AgentState], backend: Backend, eos: dict[str, set[int]],
                 chunk_tokens: int = 16, call_timeout_s: float = 300.0, transport: str | None = None,
                 lend_cores: bool = True, on_token=None, on_done=None) -> None:
        self.agents, self.backend, self.eos = agents, backend, eos
        self.on_token, self.on_done = on_token, on_done  # (agent name, token id) / (agent name): streaming
        self.chunk_tokens, self.call_timeout_s = max(1, chunk_tokens), call_timeout_s
        self.events: list[str] = []
        self.dead: set[str] = set()
        self.replicas = backend.replicas()
        self.placed: dict[str, list[AgentState]] = {r.name: [] for r in self.replicas}
        self.load = {r.name: 0 for r in self.replicas}  # unfinished agents placed on each replica
        self.decoding: dict[str, list[AgentState]] = {r.name: [] for r in self.replicas}  # in placement order
        self.placements = 0
        self.run_id = uuid.uuid4().hex[:12]  # session names are unique across concurrent runs on shared replicas
        self.fresh_sids: set[str] = set()  # sessions whose first prompt segment is queued or running
        self.dropped_sids: set[str] = set()  # sessions of agents whose run failed or was cancelled
        self.agents: dict[str, AgentState] = {}
        self.readers: dict[str, list[AgentState]] = {}
        self.streaming_readers: dict[str, list[AgentState]] = {}
        self.unfinished = 0
        self.placement = Placement()
        self.queues = CallQueues(self, backend, lend_cores)
        self.admission = Admission(self.replicas, self.agents, self.dead,
                                   lambda key, replica: self.prefixes.resident(key, replica))
        self.prefixes = PrefixSharing(self, transport)
        self.recovery = Recovery(self)
        self._register(agents)

    def _register(self, agents: dict[str, AgentState]) -> None:
        """Take `agents` (names unique across everything this scheduler runs) into its state."""
        self.agents.update(agents)
        for a in agents.values():
            self.readers[a.name] = [self.agents[c] for c in a.consumers]
            self.streaming_readers[a.name] = [c for c in self.readers[a.name] if c.streams]
        self.unfinished += len(agents)

    def add(self, agents: dict[str, AgentState]) -> None:
        """Agents of another run join the running scheduler: they are placed, batched and admitted
        with everything it runs already (`aaflow.runtime.service`)."""
        self._register(agents)
        for agent in agents.values():
            self.open_if_ready(agent)

    def forget(self, agents: list[AgentState]) -> None:
        """Drop finished (or dropped) agents from the scheduler's state once their run has ended."""
        for a in agents:
            self.agents.pop(a.name, None)
            self.readers.pop(a.name, None)
            self.streaming_readers.pop(a.name, None)
            self.recovery.preempted.pop(a.name, None)
            self.recovery.preempted_since.pop(a.name, None)
        for name, placed in self.placed.items():
            self.placed[name] = [a for a in placed if a not in agents]

    def now(self) -> float:
        return self.backend.now()

    def place(self, agent: AgentState) -> None:
        """Put `agent` on the replica `Placement` chooses."""
        alive = self.recovery.live_replicas(agent.model)
        if not alive:
            raise AgentFailedError(f"agent {agent.name!r}: no live replica serves {agent.model!r}", [agent.name])
        best = self.placement.choose(agent, alive, self.load, self.prefixes.refs.get(agent.prefix_key, {}),
                                     self.admission.fits)
        if agent.replica is not None and agent in self.placed[agent.replica]:
            self.placed[agent.replica].remove(agent)
            self.load[agent.replica] -= 1
        self.placed[best].append(agent)
        self.load[best] += 1
        agent.order, self.placements = self.placements, self.placements + 1
        agent.replica, agent.result.replica = best, best
        agent.sid = f"{self.run_id}/{agent.name}#{agent.result.restarts}"
        agent.result.strategy = agent.strategy
        agent.start_s = self.now()

    def open(self, agent: AgentState) -> None:
        self.place(agent)
        if self.admission.admit(agent):
            self.opened_admitted(agent)

    def release_kv(self, agent: AgentState) -> None:
        """`agent` ended or starts over: its KV reservation goes; open whoever admission admits now."""
        for admitted in self.admission.release(agent):
            self.opened_admitted(admitted)

    def force_admission(self) -> bool:
        """Nothing runs: open the first waiting agent anyway (preemption handles a real shortage),
        one preempted while others hold the KV after they yield it. False when nobody waits."""
        first = self.admission.head()
        if first is None:
            return False
        if first.name in self.admission.gated:
            self.recovery.yield_kv(first.replica, keep=first)
            self.backend.pause(self.recovery.backoff_s(first))
            if not self.admission.is_waiting(first):  # admitted meanwhile
                return True
        self.admission.force(first)
        self.opened_admitted(first)
        return True

    def opened_admitted(self, agent: AgentState) -> None:
        """Its KV has room on its replica: open its session (on a fork of its shared prefix or not)."""
        agent.state = "opening"
        if agent.shares_prefix:
            self.prefixes.fork_into(agent, agent.prefix_key)
            return
        self.queues.call(agent.replica, OpenCall(agent.sid), then=lambda _: self.opened(agent))

    def open_if_ready(self, agent: AgentState) -> None:
        """Streaming and prefix-sharing agents open at once; text / recompute once their inputs are done."""
        if agent.strategy in STREAMS + SHARES_PREFIX or self.inputs_done(agent):
            self.open(agent)

    def opened(self, agent: AgentState, prefix_len: int = 0) -> None:
        if agent.dropped:  # its run ended while the session opened
            self.queues.call(agent.replica, CloseCall(agent.sid))
            return
        agent.state = "open"
        if prefix_len:
            agent.fed, agent.seg, agent.offset = prefix_len, 1, 0
            agent.result.prefill_reused += prefix_len
            agent.result.prompt_tokens += prefix_len
            if agent.evicts_prefix:
                self.prefixes.evict_if_forked(agent.prefix_key)
        self.advance(agent)

    def inputs_done(self, agent: AgentState) -> bool:
        for name in agent.upstream:  # a loop, not all(): this runs for every token of every upstream
            if self.agents[name].state != "done":
                return False
        return True

    def advance(self, agent: AgentState) -> None:
        if agent.state != "open" or agent.busy:
            return
        if not agent.streams and not self.inputs_done(agent):
            return
        pieces, count, complete, streamed = feedable(self.agents, agent)
        if not complete and (not count or (agent.fed > 0 and count < self.chunk_tokens)):
            return  # wait for a full chunk (the static part goes at once)
        ids: list[int] = []
        for tokens, start in pieces:
            ids.extend(tokens[start:])
        agent.busy, agent.fresh = True, agent.fed == 0
        if agent.fresh:
            self.fresh_sids.add(agent.sid)
        consume(self.agents, agent, len(ids))
        agent.result.streamed_tokens += streamed
        agent.result.prompt_tokens += len(ids)
        call = PrefillCall(agent.sid, ids, agent.sampling if complete else None, agent.strategy != TEXT_NOCACHE)
        self.queues.call(agent.replica, call, then=lambda out: self.prefilled(agent, out))

    def prefilled(self, agent: AgentState, out: dict) -> None:
        agent.busy = False
        if agent.dropped:  # its run ended while the segment ran: its session is closed after this call
            return
        self.fresh_sids.discard(agent.sid)
        agent.result.prefill_computed += out["computed"]
        agent.result.prefill_reused += out["reused"]
        if agent.fresh:
            agent.prefix_via = agent.prefix_via or ("reuse" if out["reused"] else "recompute")
        if "token" in out:
            agent.state = "decoding"
            insort(self.decoding[agent.replica], agent, key=lambda a: a.order)
            self.token(agent, out["token"])
        else:
            self.advance(agent)

    def on_step(self, decoding: list[AgentState], tokens: list[int]) -> None:
        for agent, token in zip(decoding, tokens):
            if agent.state == "decoding":
                self.token(agent, token)

    def on_steps(self, decoding: list[AgentState], tokens: list[list[int]], ends: list[float]) -> None:
        """A group of steps: each agent's tokens, and each step's end (seconds into the call),
        which dates the tokens back from now."""
        now = self.backend.now()
        for i, end in enumerate(ends):
            t = now - (ends[-1] - end)
            for agent, row in zip(decoding, tokens):
                if i < len(row) and agent.state == "decoding":
                    self.token(agent, row[i], t)

    def token(self, agent: AgentState, token: int, t: float | None = None) -> None:
        """`agent` decoded `token` (at `t`, default now)."""
        t = self.backend.now() if t is None else t
        r = agent.result
        if r.first_token_s is None:
            r.first_token_s = t
        r.last_token_s, r.decoded = t, r.decoded + 1
        is_eos = not agent.ignore_eos and token in self.eos[agent.model]
        if not is_eos:
            agent.output.append(token)
            if self.on_token is not None:
                self.on_token(agent.name, token)
        if not is_eos and r.decoded < agent.max_tokens:
            for consumer in self.streaming_readers[agent.name]:  # the others wait for it to finish
                self.advance(consumer)
            return
        agent.state, agent.end_s = "done", t
        self.unfinished -= 1
        self.load[agent.replica] -= 1
        self.decoding[agent.replica].remove(agent)
        self.queues.call(agent.replica, CloseCall(agent.sid))
        self.release_kv(agent)
        if self.on_done is not None:
            self.on_done(agent.name)
        for consumer in self.readers[agent.name]:
            if consumer.state == "new" and self.inputs_done(consumer):
                self.open(consumer)
            else:
                self.advance(consumer)

    def run(self) -> None:
        """Run every agent to its end, then what is still queued; frees every shared prefix.
        Raises AgentFailedError naming the agents that failed and the consumers stopped."""
        try:
            self._loop()
        except BaseException:
            self.recovery.cleanup()
            raise
        self.prefixes.free_all()
        self.queues.drain(self.call_timeout_s)

    def dispose(self) -> None:
        """Drop the links to its parts, which point back at it: a finished scheduler is then freed
        by reference counting, not left to the cyclic collector (the planner runs dozens)."""
        self.queues = self.admission = self.prefixes = self.recovery = None

    def _loop(self) -> None:
        for agent in self.agents.values():
            self.open_if_ready(agent)
        while self.unfinished:
            if not self.launch():
                stuck = [a.name for a in self.agents.values() if a.state != "done"]
                raise AgentFailedError(f"workflow cannot progress; agents {stuck} wait for inputs that never come",
                                       stuck)
            ready = self.backend.wait(list(self.queues.inflight), 1, self.call_timeout_s)
            if not ready:
                names = sorted({t.replica for t in self.queues.inflight})
                raise AgentFailedError(f"replicas {names} did not answer within {self.call_timeout_s:.0f} s",
                                       [a.name for a in self.agents.values() if a.state != "done"])
            self.process(ready[0])

    def launch(self) -> bool:
        """Start what may run; False when nothing is in flight and nothing can be started."""
        while True:
            self.queues.launch()
            if self.queues.inflight:
                return True
            if not self.force_admission():
                return False

    def process(self, ticket) -> None:
        """Hand an ended call's value to what waits for it, or its failure to `Recovery`."""
        then = self.queues.finish(ticket)
        try:
            value = self.backend.result(ticket)
        except ReplicaLostError:
            self.recovery.replica_died(ticket.replica)
        except Exception as exc:  # noqa: BLE001 - named below
            cause = getattr(exc, "cause", None) or exc
            partial = getattr(cause, "partial_steps", None)
            if partial is not None:  # a group of steps failed after some ran: take their tokens first
                then(partial)
            self.recovery.call_failed(ticket, cause)
        else:
            then(value)
