"""The executor: runs a workflow DAG on a cluster, one short replica call at a time.

Per incoming-edge strategy of an agent:
  text       wait for every input, prefill the whole prompt (no KV reuse at all): the baseline;
  recompute  the same, but the replica's prefix cache may serve shared blocks;
  transfer   the static prefix (chat header + contexts) is materialized once and forked on the
             same replica, transferred to others; the rest is prefilled when the inputs are done;
  stream     the static prefix is prefilled at once; upstream tokens are prefilled in chunks while
             the upstream still decodes (position-stable segments only); the remainder at its end;
  transfer+stream  both;
  auto       per agent, the strategy the planner chose (`decisions`); without a plan, transfer+stream
             for prefixes of at least AUTO_MIN_SHARED_PREFIX tokens and stream otherwise.
Explicit KV operator nodes (see `kvops`) add prefix sharing and a replica choice on top. The
replica call queues (packing, mixed decode + prefill steps) are in `replica_calls`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from aaflow.engine.sampling import SamplingParams
from aaflow.errors import WorkflowError
from aaflow.runtime.kvops import KVDirective, directive, evicted_contexts
from aaflow.runtime.prompts import AgentInput, Segment, prompt_leaves, reorder_by_completion, static_prefix
from aaflow.runtime.prefix_sharing import PrefixSharing
from aaflow.runtime.recovery import AgentFailedError, Recovery
from aaflow.runtime.replica_calls import ReplicaCalls
from aaflow.runtime.results import AgentResult, RunResult
from aaflow.workflow.graph import STRATEGIES, AgentNode, ContextNode

SHARES_PREFIX = ("transfer", "transfer+stream", "auto")
AUTO_MIN_SHARED_PREFIX = 64  # auto shares a prefix as KV only from this many tokens (a chat header is not worth it)
STREAMS = ("stream", "transfer+stream", "auto")


@dataclass
class _Agent:
    node: AgentNode
    strategy: str
    segments: list[Segment]
    consumers: list[str]
    result: AgentResult
    kv: KVDirective = KVDirective()
    evicts_prefix: bool = False  # its prefix holds a context an evict node names
    replica: object = None
    sid: str = ""
    state: str = "new"  # new -> opening -> open -> decoding -> done
    fed: int = 0  # prompt tokens sent to the replica
    seg: int = 0  # next segment to feed, and the offset inside it
    offset: int = 0
    output: list[int] = field(default_factory=list)  # generated ids without end-of-sequence
    busy: bool = False  # a prefill of this agent is queued or running
    fresh: bool = False  # ... and it is the first of its session (nothing before it in the KV)

    @property
    def prefix_key(self) -> tuple[str, tuple[int, ...]]:
        """(model, static prefix ids): the KV of a prefix is shared only between replicas of one model."""
        return self.node.model, static_prefix(self.segments)

    @property
    def sampling(self) -> SamplingParams:
        n = self.node
        return SamplingParams(max_new_tokens=n.max_tokens, temperature=n.temperature, top_p=n.top_p, seed=n.seed,
                              ignore_eos=n.ignore_eos)


class Executor(ReplicaCalls, PrefixSharing, Recovery):
    def __init__(self, workflow, cluster, strategy: str, builders: dict, eos: dict[str, set[int]],
                 chunk_tokens: int = 16, call_timeout_s: float = 300.0, transport: str | None = None,
                 decisions: dict[str, str] | None = None, lend_cores: bool = True) -> None:
        if strategy not in STRATEGIES:
            raise WorkflowError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        self.wf, self.cluster, self.strategy, self.builders = workflow, cluster, strategy, builders
        self.eos, self.chunk_tokens, self.call_timeout_s = eos, max(1, chunk_tokens), call_timeout_s
        self.transport, self.lend_cores = transport, lend_cores
        self.start = time.perf_counter()
        self.events: list[str] = []
        self.agents: dict[str, _Agent] = {}
        evicted = evicted_contexts(workflow)
        readers: dict[str, list[str]] = {node.name: [] for node in workflow.agents()}  # in declaration order
        for node in workflow.agents():
            for up in node.upstream(workflow):
                readers[up].append(node.name)
        for node in workflow.agents():
            consumers = readers[node.name]
            segs = builders[node.model].segments(workflow, node)
            chosen = node.strategy or (decisions or {}).get(node.name) or strategy
            agent = _Agent(node, chosen, segs, consumers, AgentResult(node.name), directive(workflow, node))
            if agent.kv.share_prefix and chosen in ("recompute", "stream"):
                agent.strategy = "transfer" if chosen == "recompute" else "transfer+stream"
            agent.evicts_prefix = bool(evicted & _leading_contexts(workflow, node))
            self.agents[node.name] = agent
        self.queues: dict[str, deque] = {r.name: deque() for r in cluster.replicas()}
        self.inflight: dict = {}  # ObjectRef -> (replica name, callback, kind)
        self.involved: dict = {}  # ObjectRef -> names of the agents a call works for
        self.last_kind: dict[str, str] = {}
        self.prefix_refs: dict[tuple, dict[str, str]] = {}  # (model, prefix ids) -> {replica: ref id}
        self.prefix_waiters: dict[tuple, list[_Agent]] = {}
        self.transferring: dict[tuple, tuple | None] = {}  # prefix + (dest,) -> (source, handle, transport)
        self.prefix_origin: dict[tuple, str] = {}  # prefix -> replica materializing it
        self.dead: set[str] = set()
        self.shared_prefill_computed = 0  # tokens computed to materialize shared prefixes (no agent's own)

    def now(self) -> float:
        return time.perf_counter() - self.start

    # --- placement -----------------------------------------------------------------------
    def _place(self, agent: _Agent) -> None:
        alive = [r for r in self.cluster.replicas(agent.node.model) if r.name not in self.dead]
        if not alive:
            raise AgentFailedError(f"agent {agent.node.name!r}: no live replica serves {agent.node.model!r}")
        load = {r.name: sum(1 for a in self.agents.values() if a.replica is r and a.state != "done") for r in alive}
        holders = self.prefix_refs.get(agent.prefix_key, {})
        best = min(alive, key=lambda r: load[r.name] - (1.5 if r.name in holders else 0)
                   - (100 if r.name == agent.kv.replica else 0))
        agent.replica, agent.result.replica = best, best.name
        agent.sid = f"{agent.node.name}#{agent.result.restarts}"
        agent.result.strategy = agent.strategy

    # --- agent lifecycle -----------------------------------------------------------------
    def _open(self, agent: _Agent) -> None:
        self._place(agent)
        agent.state = "opening"
        shares = agent.strategy in SHARES_PREFIX and agent.strategy != "auto"
        long_prefix = len(static_prefix(agent.segments)) >= AUTO_MIN_SHARED_PREFIX
        if shares or agent.kv.share_prefix or (agent.strategy == "auto" and long_prefix):
            self._with_prefix(agent, agent.prefix_key)
            return
        self._call(agent.replica, "open", "session_open", agent.sid, then=lambda _: self._opened(agent))

    def _open_if_ready(self, agent: _Agent) -> None:
        """Streaming and prefix-sharing agents open at once; text / recompute once their inputs are done."""
        if agent.strategy in STREAMS + SHARES_PREFIX or self._inputs_done(agent):
            self._open(agent)

    def _opened(self, agent: _Agent, prefix_len: int = 0) -> None:
        agent.state = "open"
        if prefix_len:
            agent.fed, agent.seg, agent.offset = prefix_len, 1, 0
            agent.result.prefill_reused += prefix_len
            agent.result.prompt_tokens += prefix_len
            if agent.evicts_prefix:
                self._evict_if_forked(agent.prefix_key)
        self._advance(agent)

    def _feedable(self, agent: _Agent) -> tuple[list[int], bool, int]:
        """Tokens that may be prefilled now (position-stable), whether that completes the prompt,
        and how many of them come from upstream agents still decoding."""
        ids: list[int] = []
        streamed = 0
        if agent.node.unordered and agent.offset == 0:
            finished = sorted((a.result.last_token_s, n) for n, a in self.agents.items() if a.state == "done")
            agent.segments = reorder_by_completion(agent.segments, agent.seg, [n for _, n in finished])
        for i in range(agent.seg, len(agent.segments)):
            seg = agent.segments[i]
            start = agent.offset if i == agent.seg else 0
            if isinstance(seg, tuple):
                ids.extend(seg[start:])
                continue
            producer = self.agents[seg.agent]
            later = [s for s in agent.segments[i + 1:] if isinstance(s, AgentInput)]
            if agent.node.unordered and producer.state != "done" and start == 0 and later:
                return ids, False, streamed  # another input may finish first and take this slot
            ids.extend(producer.output[start:])
            if producer.state != "done":
                streamed += len(producer.output) - start
                return ids, False, streamed
        return ids, True, streamed

    def _consume(self, agent: _Agent, count: int) -> None:
        """Move the feed position `count` tokens forward."""
        agent.fed += count
        while count:
            seg = agent.segments[agent.seg]
            length = len(seg) if isinstance(seg, tuple) else len(self.agents[seg.agent].output)
            take = min(count, length - agent.offset)
            agent.offset += take
            count -= take
            if agent.offset == length and (isinstance(seg, tuple) or self.agents[seg.agent].state == "done"):
                agent.seg, agent.offset = agent.seg + 1, 0

    def _inputs_done(self, agent: _Agent) -> bool:
        return all(self.agents[s.agent].state == "done" for s in agent.segments if isinstance(s, AgentInput))

    def _advance(self, agent: _Agent) -> None:
        if agent.state != "open" or agent.busy:
            return
        streams = agent.strategy in STREAMS
        if not streams and not self._inputs_done(agent):
            return
        ids, complete, streamed = self._feedable(agent)
        if not complete and (not ids or (agent.fed > 0 and len(ids) < self.chunk_tokens)):
            return  # wait for a full chunk (the static part goes at once)
        agent.busy, agent.fresh = True, agent.fed == 0
        self._consume(agent, len(ids))
        agent.result.streamed_tokens += streamed
        agent.result.prompt_tokens += len(ids)
        sampling = agent.sampling if complete else None
        reuse = agent.strategy != "text"
        self._call(agent.replica, "chunk", "session_prefill", agent.sid, ids, sampling, reuse,
                   then=lambda out: self._prefilled(agent, out))

    def _prefilled(self, agent: _Agent, out: dict) -> None:
        agent.busy = False
        agent.result.prefill_computed += out["computed"]
        agent.result.prefill_reused += out["reused"]
        if "token" in out:
            agent.state = "decoding"
            self._token(agent, out["token"])
        else:
            self._advance(agent)

    def _on_step(self, decoding: list[_Agent], tokens: list[int]) -> None:
        for agent, token in zip(decoding, tokens):
            if agent.state == "decoding":
                self._token(agent, token)

    def _token(self, agent: _Agent, token: int) -> None:
        t = self.now()
        r = agent.result
        if r.first_token_s is None:
            r.first_token_s = t
        r.last_token_s, r.decoded = t, r.decoded + 1
        is_eos = token in self.eos[agent.node.model] and not agent.node.ignore_eos
        if not is_eos:
            agent.output.append(token)
        if is_eos or r.decoded >= agent.node.max_tokens:
            agent.state = "done"
            self._call(agent.replica, "close", "session_close", agent.sid)
        for name in agent.consumers:
            consumer = self.agents[name]
            if consumer.state == "new" and self._inputs_done(consumer):
                self._open(consumer)
            else:
                self._advance(consumer)

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> RunResult:
        import ray

        try:
            self._loop(ray)
        except BaseException:
            self._cleanup(ray)
            raise
        return self._result()

    def _loop(self, ray) -> None:
        for agent in self.agents.values():
            self._open_if_ready(agent)
        while any(a.state != "done" for a in self.agents.values()):
            self._launch()
            if not self.inflight:
                stuck = [a.node.name for a in self.agents.values() if a.state != "done"]
                raise AgentFailedError(f"workflow cannot progress; agents {stuck} wait for inputs that never come")
            ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=self.call_timeout_s)
            if not ready:
                names = sorted({n for n, _, _ in self.inflight.values()})
                raise AgentFailedError(f"replicas {names} did not answer within {self.call_timeout_s:.0f} s")
            ref = ready[0]
            rname, then, kind = self.inflight.pop(ref)
            involved = self.involved.pop(ref, [])
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._replica_died(rname)
                continue
            except Exception as exc:  # noqa: BLE001 - named below
                self._call_failed(rname, kind, getattr(exc, "cause", None) or exc, involved)
                continue
            then(value)
        self._launch_rest(ray)

    def _launch_rest(self, ray) -> None:
        """Run what is still queued (session closes, releases) and free the shared prefixes, so that
        no KV outlives the run."""
        for holders in self.prefix_refs.values():
            for rname, ref_id in holders.items():
                if rname not in self.dead:
                    self._call(next(r for r in self.cluster.replicas() if r.name == rname), "close", "free", ref_id)
        self.prefix_refs.clear()
        while any(self.queues[r.name] for r in self.cluster.replicas() if r.name not in self.dead) or self.inflight:
            self._launch()
            ready, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=self.call_timeout_s)
            if not ready:
                break
            for ref in ready:
                rname, then, _ = self.inflight.pop(ref)
                try:
                    then(ray.get(ref))
                except ray.exceptions.RayActorError:  # died after its agents finished: nothing to free
                    self.dead.add(rname)

    def _result(self) -> RunResult:
        for agent in self.agents.values():
            r = agent.result
            r.token_ids = list(agent.output)
            r.text = self.builders[agent.node.model].tokenizer.decode(agent.output, skip_special_tokens=True)
            ups = [self.agents[s.agent].result.last_token_s for s in agent.segments if isinstance(s, AgentInput)]
            if ups and r.first_token_s is not None:
                r.handoff_gap_s = r.first_token_s - max(ups)
            r.input_order = [s.agent for s in agent.segments if isinstance(s, AgentInput)]
        return RunResult(self.wf.name, self.strategy, {n: a.result for n, a in self.agents.items()},
                         self.now(), self.events, self.shared_prefill_computed)


def _leading_contexts(wf, node: AgentNode) -> set[str]:
    """Names of the contexts in the agent's static prefix."""
    names: set[str] = set()
    for leaf in prompt_leaves(wf, node):
        if not isinstance(leaf, ContextNode):
            break
        names.add(leaf.name)
    return names
