"""A discrete-event model of `aaflow.runtime.executor.Executor` in which every replica call takes a
predicted duration (from a `HardwareProfile` and `ModelProfile`s) instead of running.

It mirrors the executor method by method (`_open_if_ready`, `_place`, `_launch`, `_with_prefix`,
`_transfer_prefix`, `_prefix_ready`, `_advance`, `_feedable`, `_consume`, `_token`,
`_launch_rest`): the same placement, the same per-replica FIFO queue with one call in flight,
the same alternation of batched decode steps and queued calls, the same streaming rule. Call
costs: every call pays `call_overhead_s`; a prefill of n new tokens after c held ones costs
`prefill_time(n, c)`; a decode step `decode_step_time(batch, mean context)`; exposing a prefix
`link.source_copy_time` on the source (a staging copy; nothing in place), receiving it
`link.transfer_time(nbytes)` on the destination. No early end-of-sequence: every agent generates
exactly `output_tokens`.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from aaflow.errors import CostModelError
from aaflow.runtime.core_lending import LEND_MIN_TOKENS, PREFILL_KINDS
from costmodel.sim_packing import run_pack, take_pack
from costmodel.sim_state import BLOCK_TOKENS, STRATEGIES, Call, PrefixSharing, ReplicaState, SimAgent, cache_hit_tokens

if TYPE_CHECKING:
    from costmodel.hardware import HardwareProfile
    from costmodel.model_profile import ModelProfile
    from costmodel.workflow_spec import ClusterSpec, WorkflowSpec

__all__ = ["STRATEGIES", "AgentTiming", "SimResult", "simulate"]

COMPUTE_KINDS = ("prefill", "chunk", "step")  # calls that compete for the machine's cores


@dataclass(frozen=True)
class AgentTiming:
    """One agent's predicted timeline (seconds from the start of the run) and prefill work."""

    start_s: float  # opened: placed on its replica, first call queued
    first_token_s: float  # end of the prefill call that completed its prompt
    end_s: float  # its last token
    replica: str
    prefill_computed_tokens: int
    prefill_reused_tokens: int  # prefix-cache hits and forked prefix tokens
    strategy: str = ""
    prefix_via: str = ""  # how its prefix arrived: "reuse", "transfer" or "recompute"


@dataclass(frozen=True)
class SimResult:
    """Prediction for one strategy assignment."""

    makespan_s: float  # until the last queued call (closes, frees) has run
    agents: dict[str, AgentTiming] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)  # per replica: seconds of calls run
    prefill_tokens_computed: int = 0  # all prefills, prefix materializations included
    bytes_moved: int = 0  # prefix KV bytes sent between replicas
    peak_kv_bytes: int = 0  # max over time of the live KV summed over replicas

    @property
    def total_busy_s(self) -> float:
        """Replica-seconds of work: the planner's tie-break ("total compute")."""
        return sum(self.busy_s.values())

    def to_dict(self) -> dict:
        """JSON-ready."""
        return asdict(self)


def simulate(spec: WorkflowSpec, cluster: ClusterSpec, hardware: HardwareProfile,
             models: dict[str, ModelProfile], strategies: dict[str, str],
             call_overhead_s: float = 0.002) -> SimResult:
    """Predict a run of `spec` on `cluster` with one strategy per agent (names from `STRATEGIES`;
    "auto" is the executor's: "transfer+stream", sharing the prefix only from 64 tokens).
    Raises CostModelError naming the agent for an unknown strategy, model or unserved model."""
    return _Simulation(spec, cluster, hardware, models, strategies, call_overhead_s).run()


class _Simulation(PrefixSharing):
    def __init__(self, spec, cluster, hardware, models, strategies, call_overhead_s: float) -> None:
        cluster.check_serves(spec)
        for task in spec.agents:
            strategy = strategies.get(task.name)
            if strategy not in STRATEGIES:
                raise CostModelError(f"agent {task.name!r}: strategy {strategy!r} is not one of {STRATEGIES}")
            if task.model not in models:
                raise CostModelError(f"agent {task.name!r}: no ModelProfile for model {task.model!r}; "
                                     f"profiles given: {sorted(models)}")
        self.cluster, self.overhead = cluster, call_overhead_s
        self.slowdown = hardware.concurrency_slowdown
        self.lent_speedup = hardware.lent_core_speedup
        self.chunk = cluster.chunk_tokens
        self.link = hardware.link(cluster.link)
        self.memcpy_bytes_per_s = hardware.memcpy_bytes_per_s
        used = set(spec.models())
        self.replicas: dict[str, ReplicaState] = {
            name: ReplicaState(name, model, hardware.compute_for(models[model]), models[model].kv_bytes_per_token)
            for name, model in cluster.replicas if model in used}
        self.agents: dict[str, SimAgent] = {
            t.name: SimAgent(t, strategies[t.name], [t.prefix_tokens, *t.segments], spec.consumers(t.name))
            for t in spec.agents}
        self.now = 0.0
        self.heap: list[tuple[float, int, str]] = []  # (end time, launch order, replica)
        self.inflight: dict[str, tuple] = {}  # replica -> (then, value)
        self.launched = 0
        self.remaining = len(self.agents)
        self.prefix_refs: dict[tuple[str, str], dict[str, bool]] = {}  # (model, prefix key) -> holders
        self.prefix_waiters: dict[tuple[str, str, str], list[SimAgent]] = {}
        self.transferring: set[tuple[str, str, str]] = set()
        self.prefix_origin: dict[tuple[str, str], str] = {}
        self.kv_bytes = {name: 0 for name in self.replicas}
        self.peak_kv_bytes = self.bytes_moved = self.computed = 0

    def _fixed(self) -> tuple[float, None]:
        return self.overhead, None

    # --- placement -----------------------------------------------------------------------
    def _place(self, agent: SimAgent) -> None:
        alive = self.cluster.replicas_of(agent.task.model)
        load = {r: sum(1 for a in self.replicas[r].placed if a.state != "done") for r in alive}
        holders = self.prefix_refs.get((agent.task.model, agent.task.prefix_key), {})
        agent.replica = min(alive, key=lambda r: load[r] - (1.5 if r in holders else 0))
        self.replicas[agent.replica].placed.append(agent)
        agent.start_s = self.now

    # --- replica call queue --------------------------------------------------------------
    def _call(self, rname: str, kind: str, run, then=None, tokens: int = 0) -> None:
        self.replicas[rname].queue.append(Call(kind, run, then, tokens))

    def _launch(self) -> None:
        for r in self.replicas.values():
            if r.name in self.inflight:
                continue
            decoding = [a for a in r.placed if a.state == "decoding"]
            context = sum(a.kv_tokens for a in decoding) / max(1, len(decoding))
            if decoding and r.queue and r.queue[0].kind == "chunk":  # decode and prefill in one pass
                pack = take_pack(r.queue.popleft(), r.queue)
                pack_s, values = run_pack(pack, r.cached, self.overhead, r.compute.prefill_fixed_s)
                seconds = r.compute.decode_step_time(len(decoding), context) + pack_s - r.compute.prefill_fixed_s
                self._start(r, "step", seconds, lambda vs, ds=decoding, ps=pack: (
                    self._on_step(ds), [c.then(v) for c, v in zip(ps, vs)]), values)
            elif decoding and (not r.queue or r.last_kind != "step"):
                seconds = self.overhead + r.compute.decode_step_time(len(decoding), context)
                self._start(r, "step", seconds, lambda _, ds=decoding: self._on_step(ds), None)
            elif r.queue:
                call = r.queue.popleft()
                if call.kind == "chunk" and len(pack := take_pack(call, r.queue)) > 1:
                    seconds, values = run_pack(pack, r.cached, self.overhead, r.compute.prefill_fixed_s)
                    seconds /= self._lent_speedup(r, sum(c.tokens for c in pack))
                    self._start(r, "chunk", seconds, lambda vs, ps=pack: [c.then(v) for c, v in zip(ps, vs)], values)
                    continue
                seconds, value = call.run()
                if call.kind in PREFILL_KINDS:
                    seconds /= self._lent_speedup(r, call.tokens)
                self._start(r, call.kind, seconds, call.then, value)

    def _lent_speedup(self, r: ReplicaState, tokens: int) -> float:
        """As the executor lends cores (`aaflow.runtime.core_lending`): a prefill of LEND_MIN_TOKENS or
        more, started while every other replica has nothing in flight or queued and its unfinished
        agents all wait for a shared prefix, runs `lent_core_speedup` times faster."""
        if tokens < LEND_MIN_TOKENS or self.lent_speedup == 1.0:
            return 1.0
        others = [o for o in self.replicas.values() if o is not r]
        waiting = {id(a) for waiters in self.prefix_waiters.values() for a in waiters}
        idle = all(o.name not in self.inflight and not o.queue
                   and all(a.state == "done" or id(a) in waiting for a in o.placed) for o in others)
        return self.lent_speedup if others and idle else 1.0

    def _start(self, r: ReplicaState, kind: str, seconds: float, then, value) -> None:
        if kind in COMPUTE_KINDS and any(self.replicas[n].last_kind in COMPUTE_KINDS for n in self.inflight):
            seconds *= self.slowdown  # another replica of this machine computes at the same time
        r.busy_s += seconds
        r.last_kind = kind
        self.launched += 1
        heapq.heappush(self.heap, (self.now + seconds, self.launched, r.name))
        self.inflight[r.name] = (then, value)

    def _finish(self, rname: str) -> None:
        then, value = self.inflight.pop(rname)
        if then is not None:
            then(value)
        self.kv_bytes[rname] = self.replicas[rname].live_kv_bytes()
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(self.kv_bytes.values()))

    # --- agent lifecycle -----------------------------------------------------------------
    def _open(self, agent: SimAgent) -> None:
        self._place(agent)
        agent.state = "opening"
        if agent.shares_prefix:
            self._with_prefix(agent)
            return
        self._call(agent.replica, "open", self._fixed, then=lambda _: self._opened(agent))

    def _open_if_ready(self, agent: SimAgent) -> None:
        if agent.streams or agent.shares_prefix or self._inputs_done(agent):
            self._open(agent)

    def _opened(self, agent: SimAgent, prefix_len: int = 0) -> None:
        agent.state, agent.session = "open", True
        if prefix_len:
            agent.fed, agent.seg, agent.offset = prefix_len, 1, 0
            agent.reused += prefix_len
            agent.kv_tokens = agent.shared_tokens = prefix_len
        self._advance(agent)

    def _feedable(self, agent: SimAgent) -> tuple[int, bool]:
        """Tokens that may be prefilled now (position-stable) and whether that completes the prompt."""
        count = 0
        for i in range(agent.seg, len(agent.segments)):
            seg = agent.segments[i]
            start = agent.offset if i == agent.seg else 0
            if isinstance(seg, int):
                count += seg - start
                continue
            producer = self.agents[seg]
            count += producer.decoded - start
            if producer.state != "done":
                return count, False
        return count, True

    def _consume(self, agent: SimAgent, count: int) -> None:
        agent.fed += count
        while count:
            seg = agent.segments[agent.seg]
            length = seg if isinstance(seg, int) else self.agents[seg].decoded
            take = min(count, length - agent.offset)
            agent.offset += take
            count -= take
            if agent.offset == length and (isinstance(seg, int) or self.agents[seg].state == "done"):
                agent.seg, agent.offset = agent.seg + 1, 0

    def _inputs_done(self, agent: SimAgent) -> bool:
        return all(self.agents[s].state == "done" for s in agent.task.upstream)

    def _advance(self, agent: SimAgent) -> None:
        if agent.state != "open" or agent.busy:
            return
        if not agent.streams and not self._inputs_done(agent):
            return
        count, complete = self._feedable(agent)
        if not complete and (not count or (agent.fed > 0 and count < self.chunk)):
            return  # wait for a full chunk (the static part goes at once)
        agent.busy = True
        held = agent.fed
        self._consume(agent, count)
        shares = min(agent.task.prefix_tokens, count) if held == 0 and agent.strategy != "text" else 0
        self.replicas[agent.replica].queue.append(Call(
            "chunk", lambda: self._prefill_cost(agent, count, held),
            lambda out: self._prefilled(agent, count, held, complete, out), count, agent.task.prefix_key, shares))

    def _prefill_cost(self, agent: SimAgent, count: int, held: int) -> tuple[float, tuple[int, int]]:
        r = self.replicas[agent.replica]
        hit = 0
        if agent.strategy != "text" and held == 0 and agent.task.prefix_key in r.cached:
            hit = cache_hit_tokens(agent.task.prefix_tokens, count)
        self.computed += count - hit
        if held == 0 and count >= agent.task.prefix_tokens:  # its blocks are sealed as they are computed
            r.cached.add(agent.task.prefix_key)
        return self.overhead + r.compute.prefill_time(count - hit, held + hit), (count - hit, hit)

    def _prefilled(self, agent: SimAgent, count: int, held: int, complete: bool, out: tuple[int, int]) -> None:
        computed, hit = out
        agent.busy = False
        agent.computed += computed
        agent.reused += hit
        agent.kv_tokens += count
        prefix = agent.task.prefix_tokens
        if held == 0:
            agent.prefix_via = agent.prefix_via or ("reuse" if hit else "recompute")
            if agent.strategy != "text":  # its prefix blocks are (or become) shared cache blocks
                agent.shared_tokens = min(prefix, count) // BLOCK_TOKENS * BLOCK_TOKENS
        if complete:
            agent.state = "decoding"
            self._token(agent)
        else:
            self._advance(agent)

    def _on_step(self, decoding: list[SimAgent]) -> None:
        for agent in decoding:
            if agent.state == "decoding":
                agent.kv_tokens += 1
                self._token(agent)

    def _token(self, agent: SimAgent) -> None:
        if agent.first_token_s is None:
            agent.first_token_s = self.now
        agent.decoded += 1
        if agent.decoded >= agent.task.output_tokens:
            agent.state, agent.end_s = "done", self.now
            self.remaining -= 1
            self._call(agent.replica, "close", self._fixed, then=lambda _: setattr(agent, "session", False))
        for name in agent.consumers:
            consumer = self.agents[name]
            if consumer.state == "new" and self._inputs_done(consumer):
                self._open(consumer)
            else:
                self._advance(consumer)

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> SimResult:
        for agent in self.agents.values():
            self._open_if_ready(agent)
        while self.remaining:
            self._launch()
            if not self.inflight:
                stuck = [a.name for a in self.agents.values() if a.state != "done"]
                raise CostModelError(f"workflow cannot progress; agents {stuck} wait for inputs that never come")
            end, _, rname = heapq.heappop(self.heap)
            self.now = end
            self._finish(rname)
        self._launch_rest()
        return self._result()

    def _launch_rest(self) -> None:
        """Run what is still queued and free the shared prefixes; like the executor, wait for every
        call in flight before launching the next round."""
        for (_, prefix_key), holders in self.prefix_refs.items():
            for rname in holders:
                self._call(rname, "close", self._fixed,
                           then=lambda _, r=self.replicas[rname], k=prefix_key: r.refs.pop(k, None))
        self.prefix_refs.clear()
        while any(r.queue for r in self.replicas.values()) or self.inflight:
            self._launch()
            batch = sorted(self.heap, key=lambda e: e[1])
            self.heap.clear()
            self.now = max(end for end, _, _ in batch)
            for _, _, rname in batch:
                self._finish(rname)

    def _result(self) -> SimResult:
        timings = {a.name: AgentTiming(a.start_s, a.first_token_s, a.end_s, a.replica, a.computed, a.reused,
                                       a.strategy, a.prefix_via) for a in self.agents.values()}
        return SimResult(self.now, timings, {r.name: r.busy_s for r in self.replicas.values()},
                         self.computed, self.bytes_moved, self.peak_kv_bytes)
