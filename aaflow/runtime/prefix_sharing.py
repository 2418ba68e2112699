"""Prefix sharing: a static prefix (chat header + leading contexts) is materialized once per
workflow, forked by every agent on the same replica and transferred to other replicas that need
it; an evict node evicts it (`aaflow.operators.evict`: its blocks leave the pool, a later fork rebuilds it
from lineage) once its agents have forked it; it is freed when no pending agent reads it. A failed
transfer falls back to recomputing the prefix where it was going. Whether a replica that lacks a
prefix waits for it to be moved or computes it itself, the cost model says where it can
(`aaflow.runtime.prefix_costs`). A prefix that a compose node asks to compose approximately is
made of its parts (`prefix_compose`); the agents forking it carry the compose's FidelityReport."""

from __future__ import annotations

from typing import Callable

from aaflow.runtime.agent_state import AgentPhase, AgentState
from aaflow.runtime.calls import Call, EvictCall, FreeCall, MaterializeCall, OpenCall
from aaflow.runtime.call_queues import CallQueues, Timed
from aaflow.runtime.kv_move import MoveInFlight, start_move
from aaflow.runtime.prefix_compose import Compositions, pieces
from aaflow.runtime.prefix_decisions import PrefixDecisions
from aaflow.runtime.prefix_key import PlacedPrefix, PrefixKey
from aaflow.runtime.scheduler_state import SchedulerState


class PrefixSharing:
    """Owns which replica holds which shared prefix, who waits for one and what is in transit.
    It reads the scheduler's `state` and sends its calls through `queues`; an agent whose session
    opened on a fork of its prefix is handed to `forked(agent, replica, session id, prefix length)`."""

    def __init__(self, state: SchedulerState, queues: CallQueues, transport: str | None,
                 forked: Callable[[AgentState, str, str, int], None]) -> None:
        self.state, self.queues, self._transport, self.forked = state, queues, transport, forked
        self.refs: dict[PrefixKey, dict[str, str]] = {}  # prefix -> {replica: ref id}
        self.waiters: dict[PlacedPrefix, list[AgentState]] = {}  # agents waiting for a prefix on their replica
        self.transferring: dict[PlacedPrefix, MoveInFlight] = {}  # a prefix's move to its destination
        self.origin: dict[PrefixKey, str] = {}  # prefix -> replica materializing it
        self.origin_since: dict[PrefixKey, float] = {}  # prefix -> when its origin was asked to materialize it
        self.computing_here: set[PlacedPrefix] = set()  # being computed there (nothing is moved there)
        self._costs, self._costs_asked = None, False
        self.compositions = Compositions(queues)
        self.evicted: set[PlacedPrefix] = set()  # evicted by an evict node: a ref, not resident
        self.computed = 0  # tokens computed to materialize shared prefixes (no agent's own)
        self.computed_for: dict[str, int] = {}  # agent -> those tokens, counted for the first agent waiting
        self.fidelity: dict[PrefixKey, object] = {}  # prefix -> FidelityReport of a composed prefix
        self.decisions = PrefixDecisions()  # how replicas got the prefixes they lacked

    def transport(self, waiting: list[AgentState] | None = None) -> str:
        """The transport a prefix moves over: its first waiting agent's run's, else the scheduler's,
        else the backend's default (asked once)."""
        for agent in waiting or ():
            options = getattr(agent, "options", None)
            if options is not None and options.transport is not None:
                return options.transport
        if self._transport is None:
            self._transport = self.state.backend.default_transport()
        return self._transport

    @property
    def costs(self):
        """The cost model's `PrefixCosts` for this scheduler's replicas (asked of the backend once), or None."""
        if not self._costs_asked:
            self._costs, self._costs_asked = self.state.backend.prefix_costs(), True
        return self._costs

    def stop_waiting(self, agent: AgentState) -> None:
        """`agent`'s run ended: it waits for no prefix."""
        for key, waiting in list(self.waiters.items()):
            if agent in waiting:
                waiting.remove(agent)
                if not waiting:
                    del self.waiters[key]

    def on_its_way(self, prefix: PrefixKey) -> bool:
        """Something is still being computed or moved for `prefix` somewhere."""
        return any(k.prefix == prefix for k in self.waiters) or any(k.prefix == prefix for k in self.transferring)

    def waiting_agents(self) -> set[int]:
        """ids of the agents waiting for a prefix to arrive."""
        return {id(a) for waiters in self.waiters.values() for a in waiters}

    def fork_into(self, agent: AgentState, prefix: PrefixKey) -> None:
        """Open the agent's session on a fork of the prefix's KV on its replica, materializing or
        transferring the prefix first."""
        holders = self.refs.setdefault(prefix, {})
        rname = agent.replica
        if rname in holders:
            self.evicted.discard(PlacedPrefix(prefix, rname))  # the fork brings it back
            agent.prefix_via = agent.prefix_via or "reuse"
            agent.result.fidelity = self.fidelity.get(prefix)
            sid = agent.sid
            self.queues.call(rname, OpenCall(sid, holders[rname]), then=lambda _: self.forked(agent, rname, sid, len(prefix.ids)))
            return
        waiting = self.waiters.setdefault(PlacedPrefix(prefix, rname), [])
        waiting.append(agent)
        if len(waiting) > 1:
            return
        self._fetch(prefix, rname, agent.planned, _fetch_of(agent))

    def _fetch(self, prefix: PrefixKey, rname: str, planned: bool = False, how: str = "auto") -> None:
        """Bring the prefix to `rname`: moved from a live replica that holds it, else computed there
        (once: while another replica computes it, `rname` waits to receive it). `how` (the run's
        `prefix_fetch`) "compute" computes it on `rname` instead, "move" never does; "auto" does
        where the agent is `planned` (its strategy is the planner's, not one the user named) and
        the cost model says computing it on `rname` ends sooner than either."""
        holders = self.refs.setdefault(prefix, {})
        source = next((r for r in self.queues.replicas if r in holders and r not in self.state.dead), None)
        if source is not None:
            if self._compute_rather(prefix, 0.0, planned, how):
                self._compute_here(prefix, rname, how)
            else:
                self._transfer(prefix, source, rname, holders[source])
        elif prefix not in self.origin:
            self.origin[prefix], self.origin_since[prefix] = rname, self.state.now()
            self.computing_here.add(PlacedPrefix(prefix, rname))
            self._materialize(prefix, rname, "first")
        elif self._compute_rather(prefix, None, planned, how):
            self._compute_here(prefix, rname, how)

    def _compute_rather(self, prefix: PrefixKey, holder_ready_in_s: float | None, planned: bool, how: str) -> bool:
        """Whether `rname` computes the prefix rather than receive it from a holder that has it in
        `holder_ready_in_s` (None: from the origin computing it now)."""
        if prefix.compose is not None or how == "move":
            return False
        if how == "compute":
            return True
        costs = self.costs
        if not planned or costs is None:
            return False
        ready_in = self._ready_in(prefix) if holder_ready_in_s is None else holder_ready_in_s
        return costs.compute_here(prefix.model, len(prefix.ids), ready_in)

    def _ready_in(self, prefix: PrefixKey) -> float:
        """Seconds until the prefix's origin has computed it, as the cost model expects."""
        elapsed = self.state.now() - self.origin_since.get(prefix, self.state.now())
        return self.costs.ready_in_s(prefix.model, len(prefix.ids), elapsed)

    def _compute_here(self, prefix: PrefixKey, rname: str, how: str) -> None:
        self.computing_here.add(PlacedPrefix(prefix, rname))
        why = "sooner than moving it there (cost model)" if how == "auto" else "the run's prefix_fetch"
        self.state.note(f"computing a prefix of {len(prefix.ids)} tokens on {rname}: {why}")
        self._materialize(prefix, rname, "compute", chosen=how == "auto")

    def _materialize(self, prefix: PrefixKey, rname: str, kind: str, chosen: bool = False) -> None:
        """Compute the prefix on `rname` (a decision of `kind`: `prefix_decisions`, `chosen` by the
        cost model or not): in one piece, or its contexts apart and then composed."""
        if prefix.compose is None:
            costs = self.costs

            def materialized(record) -> None:  # priced at the tokens computed (the prefix cache may have had some)
                predicted = costs.compute_s(prefix.model, record.computed) if costs is not None else None
                self.decisions.record(kind, record.computed, 0, predicted, call.ran_s(), chosen)
                self._materialized(prefix, rname, record)

            call = Timed(materialized, self.state.now)
            self.queues.call(rname, MaterializeCall(list(prefix.ids)), then=call)
            return

        def composed(record, computed: int) -> None:
            self.fidelity[prefix] = record.fidelity
            self._count(prefix, rname, computed)
            self._ready(prefix, rname, record.id, 0, received=False)

        self.compositions.start(prefix, rname, composed)

    def _transfer(self, prefix: PrefixKey, source: str, dest: str, ref_id: str) -> None:
        key = PlacedPrefix(prefix, dest)
        costs, waiting = self.costs, self.waiters.get(key, [])
        chosen = costs is not None and any(a.planned and _fetch_of(a) == "auto" for a in waiting)  # else moved unasked

        def received(answer) -> None:
            move = self.transferring.pop(key, None)
            if move is not None:
                predicted = costs.move_s(prefix.model, len(prefix.ids)) if costs is not None else None
                self.decisions.record(f"move:{move.transport}", len(prefix.ids), answer.stats.nbytes, predicted,
                                      move.ran_s, chosen)
            self._ready(prefix, dest, answer.record.id, answer.stats.nbytes, received=True)

        self.transferring[key] = start_move(self.queues, source, dest, ref_id, self.transport(waiting),
                                            received)

    def _count(self, prefix: PrefixKey, rname: str, tokens: int) -> None:
        """`tokens` were computed to make `prefix` on `rname`; its first waiter's run counts them."""
        self.computed += tokens
        waiters = self.waiters.get(PlacedPrefix(prefix, rname))
        if waiters:
            name = waiters[0].name
            self.computed_for[name] = self.computed_for.get(name, 0) + tokens

    def _materialized(self, prefix: PrefixKey, rname: str, record) -> None:
        self._count(prefix, rname, record.computed)
        self._ready(prefix, rname, record.id, 0, received=False)

    def _ready(self, prefix: PrefixKey, rname: str, ref_id: str, nbytes: int, received: bool) -> None:
        holders = self.refs.setdefault(prefix, {})
        self.computing_here.discard(PlacedPrefix(prefix, rname))
        if rname in holders:  # it arrived there twice: keep one
            self.queues.call(rname, FreeCall(ref_id))
            ref_id = holders[rname]
        holders[rname] = ref_id
        waiters = self.waiters.pop(PlacedPrefix(prefix, rname), [])
        if waiters:  # one transfer serves every waiter: its bytes count once, for the first
            waiters[0].result.bytes_moved += nbytes
        for i, agent in enumerate(waiters):
            agent.prefix_via = agent.prefix_via or ("transfer" if received else "recompute" if i == 0 else "reuse")
            self.fork_into(agent, prefix)
        for key, waiting in list(self.waiters.items()):  # replicas waiting for this prefix
            if key.prefix == prefix and waiting and key not in self.transferring and key not in self.computing_here:
                self._transfer(prefix, rname, waiting[0].replica, ref_id)

    def evict_if_forked(self, prefix: PrefixKey) -> None:
        """An evict node named a context of this prefix: evict its shared KV on every replica once
        every agent that shares it has forked it (an agent restarted later forks it again: the
        replica rebuilds it from its lineage)."""
        sharers = [a for a in self.state.agents.values() if a.prefix_key == prefix and a.evicts_prefix]
        resident = [r for r in self.refs.get(prefix, {}) if self.resident(prefix, r) and r not in self.state.dead]
        if not resident or any(a.state in (AgentPhase.NEW, AgentPhase.OPENING) for a in sharers):
            return
        for rname in resident:
            self.queues.call(rname, EvictCall(self.refs[prefix][rname]))
            self.evicted.add(PlacedPrefix(prefix, rname))
        self.state.note(f"evicted a shared prefix of {len(prefix.ids)} tokens")

    def drop_held(self, rname: str) -> None:
        """Free the shared prefixes held on `rname` (calls already queued there that use them run
        first); an agent that needs one again has it computed or transferred anew."""
        for prefix, holders in self.refs.items():
            if rname in holders:
                self.queues.call(rname, FreeCall(holders.pop(rname)))
                if self.origin.get(prefix) == rname:
                    del self.origin[prefix]

    def let_go(self) -> list[tuple[str, Call]]:
        """After a failed run: forget every shared prefix; answers the calls that end the exposures
        (they hold the sources' blocks) and free the prefixes and composed prefixes' parts held on
        live replicas."""
        dead = self.state.dead
        calls = [(m.source, m.release_call()) for m in self.transferring.values()
                 if m.release_call() and m.source not in dead]
        calls += [(r, FreeCall(ref_id)) for holders in self.refs.values() for r, ref_id in holders.items() if r not in dead]
        calls += self.compositions.let_go(dead)
        self.transferring.clear()
        self.refs.clear()
        self.evicted.clear()
        return calls

    def free_unread(self, keys: set) -> int:
        """Free the shared prefixes of `keys` that are held, that no unfinished agent of any run
        will read (a prefix other runs' pending agents read stays: it is computed once) and that
        nothing is on its way for. Answers how many it freed."""
        keys = {k for k in keys if k in self.refs}
        if not keys:
            return 0
        pending = {a.prefix_key for a in self.state.agents.values() if a.state != AgentPhase.DONE and a.prefix_key in keys}
        unread = [key for key in keys - pending if not self.on_its_way(key)]
        for key in unread:
            self.forget(key)
        return len(unread)

    def free_all(self) -> None:
        """Free every shared prefix still held (at the end of a run)."""
        for prefix in list(self.refs):
            self.forget(prefix)

    def forget(self, prefix: PrefixKey) -> None:
        """Free the prefix's shared KV wherever it is held, and forget it."""
        self.free(self.refs.pop(prefix, {}))
        self.origin.pop(prefix, None)
        self.origin_since.pop(prefix, None)
        self.evicted -= {k for k in self.evicted if k.prefix == prefix}

    def resident(self, prefix: PrefixKey, rname: str) -> bool:
        """`rname` holds the prefix's shared KV, not evicted."""
        return rname in self.refs.get(prefix, {}) and PlacedPrefix(prefix, rname) not in self.evicted

    def free(self, holders: dict[str, str]) -> None:
        for rname, ref_id in holders.items():
            if rname not in self.state.dead:
                self.queues.call(rname, FreeCall(ref_id))

    def replica_died(self, rname: str) -> None:
        """Forget what the dead replica held or awaited; whoever waited for a prefix it was
        computing computes it now."""
        for holders in self.refs.values():
            holders.pop(rname, None)
        self.evicted = {k for k in self.evicted if k.replica != rname}
        self.computing_here = {k for k in self.computing_here if k.replica != rname}
        self.waiters = {k: v for k, v in self.waiters.items() if k.replica != rname}
        for key, move in list(self.transferring.items()):
            if key.replica == rname:
                del self.transferring[key]
                if move.release_call() and move.source not in self.state.dead:  # the source still exposes it
                    self.queues.call(move.source, move.release_call())
            elif move.source == rname:  # the source died: the destination gets it another way
                del self.transferring[key]
                self._fetch(key.prefix, key.replica)
        for prefix in [p for p, origin in self.origin.items() if origin == rname]:
            del self.origin[prefix]
            for key in [k for k in self.waiters if k.prefix == prefix]:
                for agent in self.waiters.pop(key):
                    self.fork_into(agent, prefix)

    def materialize_refused(self, rname: str, token_ids) -> list[AgentState]:
        """The replica had no room to compute a shared prefix, or a part of a composed one: hand
        back the agents waiting for it there, to be preempted (and, if it was computed there for
        everyone, every agent waiting for it anywhere, forgetting that it is computed there; a
        composition's parts made so far are freed); the first of them to open again fetches or
        computes it then. [] when nothing waits for those tokens there."""
        tokens = tuple(token_ids)
        prefix = next((p for p, origin in self.origin.items() if origin == rname and tokens in pieces(p)), None)
        if prefix is not None:
            del self.origin[prefix]
            keys = [k for k in self.waiters if k.prefix == prefix]
        else:  # computed there after a failed transfer to it: its own waiters only
            prefix = next((k.prefix for k in self.waiters if k.replica == rname and tokens in pieces(k.prefix)), None)
            keys = [] if prefix is None else [PlacedPrefix(prefix, rname)]
        if prefix is not None:
            self.computing_here.discard(PlacedPrefix(prefix, rname))
            self.compositions.abandon(prefix, rname)
        return [agent for key in keys for agent in self.waiters.pop(key)]

    def transfer_failed(self) -> None:
        """Recompute every prefix in transit where it was going; release what the sources exposed."""
        for key, move in list(self.transferring.items()):
            del self.transferring[key]
            if move.release_call():
                self.queues.call(move.source, move.release_call())
            self.computing_here.add(key)
            self._materialize(key.prefix, key.replica, "recompute-after-failed-move")


def _fetch_of(agent: AgentState) -> str:
    """The `prefix_fetch` of the agent's run ("auto" for an agent without run options)."""
    options = getattr(agent, "options", None)
    return options.prefix_fetch if options is not None else "auto"
