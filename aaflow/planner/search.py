"""The planner: one strategy per agent, chosen by running the scheduler on the simulated clock
(`aaflow.planner.simulate`).

Search: simulate uniform "text" (the baseline) and each uniform candidate, start from the best,
then coordinate descent over agents (a few passes: try each candidate for one agent, keep it if the
prediction improves; in large workflows, for one group of interchangeable agents at a time).
Order: shorter makespan, then less total replica work, then simpler strategies; makespans within
MAKESPAN_TIE of each other count as equal (the model is not that exact, and of two plans as fast,
the one that computes less leaves the machine's other cores free and suffers less when replicas
contend for them). A plan replaces text for everyone only when it is predicted at least
MIN_GAIN_OVER_TEXT faster: smaller gains are within the simulator's error, and measured they were
as often losses as gains (docs/RESULTS-history.md).
"""

from __future__ import annotations

from dataclasses import replace
from operator import itemgetter
from typing import TYPE_CHECKING

from aaflow.common.errors import CostModelError
from aaflow.planner.plans import Plan
from aaflow.planner.simulate import SimResult, simulate
from aaflow.common.strategies import STREAMS, TEXT_NOCACHE
from aaflow.costmodel.units import format_seconds

if TYPE_CHECKING:
    from aaflow.costmodel.hardware import HardwareProfile
    from aaflow.costmodel.model_profile import ModelProfile
    from aaflow.costmodel.workflow_spec import AgentTask, ClusterSpec, WorkflowSpec

CANDIDATES = ("recompute", "transfer", "stream", "transfer+stream")
SIMPLICITY = {"text": 0, "recompute": 1, "transfer": 2, "stream": 3, "transfer+stream": 4}
# With no upstream agent there is nothing to stream: these behave exactly like the simpler one.
NO_INPUT_EQUIVALENT = {"stream": "recompute", "transfer+stream": "transfer"}
MAKESPAN_TIE = 0.03  # predicted makespans this close (relative) are a tie, broken by total work
MIN_GAIN_OVER_TEXT = 0.10  # a plan must be predicted this much faster than text (relative) to be chosen
# Up to this many agents the descent moves one agent at a time; beyond, one group of
# interchangeable agents at a time (a simulation costs O(agents x events): per-agent moves over
# 256 agents took minutes).
PER_AGENT_SEARCH_MAX = 32


def plan_workflow(spec: WorkflowSpec, cluster: ClusterSpec, hardware: HardwareProfile,
                  models: dict[str, ModelProfile], candidates: tuple[str, ...] = CANDIDATES,
                  call_overhead_s: float = 0.002, max_passes: int = 3) -> Plan:
    """Choose a strategy per agent minimizing the simulated makespan of `spec` on `cluster`.

    `candidates` are the strategies the planner may pick ("text" is always simulated as the
    baseline and used when nothing beats it). Raises CostModelError for an unknown candidate and
    for whatever `simulate` rejects (unknown models, unserved models)."""
    unknown = [c for c in candidates if c not in SIMPLICITY]
    if unknown or not candidates:
        raise CostModelError(f"unknown planner candidates {unknown or candidates!r}; choose from {tuple(SIMPLICITY)}")
    search = _Search(spec, cluster, hardware, models, tuple(dict.fromkeys(candidates)), call_overhead_s)
    baseline = search.sim(search.uniform("text"))
    alternatives = {c: search.sim(search.uniform(c)) for c in search.candidates}
    current = search.normalize(search.uniform(search.candidates[0]))
    for c in search.candidates[1:]:
        if search.better(uniform := search.normalize(search.uniform(c)), current):
            current = uniform
    many = len(spec.agents) > PER_AGENT_SEARCH_MAX
    units = interchangeable_groups(spec) if many else [[t.name] for t in spec.agents]
    for _ in range(max_passes):
        improved = False
        for unit in units:
            for strategy in search.options[unit[0]]:
                trial = {**current, **{name: strategy for name in unit}}
                if search.better(trial, current):
                    current, improved = trial, True
        if not improved:
            break
    if search.sim(current).makespan_s > baseline.makespan_s * (1 - MIN_GAIN_OVER_TEXT):
        current = search.uniform("text")
    predicted = search.sim(current)
    runner_up = {}
    for unit in units:  # one member of a group of interchangeable agents stands for all of them
        name = unit[0]
        others = [{**current, name: s} for s in search.options[name] + ["text"] if s != current[name]]
        if others:
            best = min(others, key=search.key)
            runner_up.update(dict.fromkeys(unit, (best[name], search.sim(best).makespan_s)))
    reasons = {t.name: _reason(t, current, predicted, spec, cluster, hardware, models) for t in spec.agents}
    return Plan(spec, dict(current), predicted, baseline, alternatives, runner_up, hardware.name,
                not hardware.measured, reasons)


def interchangeable_groups(spec: WorkflowSpec) -> list[list[str]]:
    """The agents in groups of the same model, prefix, output length and segments, whose upstream
    agents come from the same groups (in declaration order: upstream agents are declared first).
    Who reads an agent is not compared: a group only makes the search coarser, never wrong."""
    group_of: dict[str, int] = {}
    signatures: dict[tuple, int] = {}
    groups: list[list[str]] = []
    for task in spec.agents:
        segments = tuple(("agent", group_of.get(s, s)) if isinstance(s, str) else s for s in task.segments)
        signature = (task.model, task.prefix_key, task.prefix_tokens, task.output_tokens, segments)
        index = signatures.setdefault(signature, len(groups))
        if index == len(groups):
            groups.append([])
        groups[index].append(task.name)
        group_of[task.name] = index
    return groups


class _Search:
    """Memoized simulations of strategy assignments, and the order they are ranked by."""

    def __init__(self, spec, cluster, hardware, models, candidates: tuple[str, ...], call_overhead_s: float) -> None:
        self.spec, self.cluster, self.hardware, self.models = spec, cluster, hardware, models
        self.candidates, self.call_overhead_s = candidates, call_overhead_s
        self.cache: dict[tuple[str, ...], SimResult] = {}
        names = [t.name for t in spec.agents]
        pick = itemgetter(*names)  # the strategies in agent order, read in C: the memo key
        self._key = pick if len(names) > 1 else (lambda assignment: (pick(assignment),))
        self.options = {t.name: self._options(t) for t in spec.agents}
        self.fastest = float("inf")  # the shortest makespan `better` has seen

    def _options(self, task: AgentTask) -> list[str]:
        if task.upstream:
            return list(self.candidates)
        return [c for c in self.candidates if NO_INPUT_EQUIVALENT.get(c) not in self.candidates]

    def uniform(self, strategy: str) -> dict[str, str]:
        return {t.name: strategy for t in self.spec.agents}

    def normalize(self, assignment: dict[str, str]) -> dict[str, str]:
        """Replace a strategy an agent without inputs cannot use by its simpler equivalent."""
        return {name: (s if s in self.options[name] or s == "text" else NO_INPUT_EQUIVALENT.get(s, s))
                for name, s in assignment.items()}

    def sim(self, assignment: dict[str, str]) -> SimResult:
        """The simulation of `assignment`, memoized. An assignment that differs from an earlier one
        only where an agent without inputs takes a strategy's simpler equivalent (uniform "stream"
        against recompute for the agents that read nothing) runs identically: it reuses that
        simulation, with each agent's timing naming the strategy asked for."""
        key = self._key(assignment)
        if key not in self.cache:
            canonical = self.normalize(assignment)
            same = self._key(canonical)
            if same not in self.cache:
                self.cache[same] = simulate(self.spec, self.cluster, self.hardware, self.models, canonical,
                                            call_overhead_s=self.call_overhead_s)
            self.cache[key] = self.cache[same] if same == key else _renamed(self.cache[same], assignment)
        return self.cache[key]

    def better(self, a: dict[str, str], b: dict[str, str]) -> bool:
        """Whether assignment `a` ranks before `b` (see the module docstring). A tie never admits a
        plan more than MAKESPAN_TIE slower than the fastest simulated so far, so ties cannot drift."""
        ma, mb = self.sim(a).makespan_s, self.sim(b).makespan_s
        self.fastest = min(self.fastest, ma, mb)
        if abs(ma - mb) > MAKESPAN_TIE * max(ma, mb) or ma > self.fastest * (1 + MAKESPAN_TIE):
            return ma < mb
        return self.key(a)[1:] < self.key(b)[1:]

    def key(self, assignment: dict[str, str]) -> tuple[float, float, int]:
        result = self.sim(assignment)
        return (round(result.makespan_s, 9), round(result.total_busy_s, 9),
                sum(SIMPLICITY[s] for s in assignment.values()))


def _renamed(result: SimResult, assignment: dict[str, str]) -> SimResult:
    """`result` with each agent's timing naming its strategy in `assignment`."""
    agents = {name: replace(t, strategy=assignment[name]) if t.strategy != assignment[name] else t
              for name, t in result.agents.items()}
    return replace(result, agents=agents)


def _reason(task: AgentTask, decisions: dict[str, str], result: SimResult, spec: WorkflowSpec,
            cluster: ClusterSpec, hardware: HardwareProfile, models: dict[str, ModelProfile]) -> str:
    """Why this agent's strategy pays, in one line."""
    strategy, timing = decisions[task.name], result.agents[task.name]
    n = task.prefix_tokens
    model = models[task.model]
    recompute_s = hardware.compute_for(model).prefill_time(n)
    parts = []
    if strategy in ("transfer", "transfer+stream") and n:
        nbytes = n * model.kv_bytes_per_token
        link = hardware.link(cluster.link)
        transfer_s = link.source_copy_time(nbytes, hardware.memcpy_bytes_per_s) + link.transfer_time(nbytes)
        if timing.prefix_via == "transfer":
            cmp = "<" if transfer_s < recompute_s else ">="
            parts.append(f"prefix of {n:,} tokens sent to {timing.replica}: transfer {format_seconds(transfer_s)} "
                         f"{cmp} recompute {format_seconds(recompute_s)}")
        elif timing.prefix_via == "reuse":
            parts.append(f"prefix of {n:,} tokens already on {timing.replica}: fork, not recompute "
                         f"{format_seconds(recompute_s)}")
        else:
            sharers = sum(1 for t in spec.agents if t.model == task.model and t.prefix_key == task.prefix_key
                          and decisions[t.name] in ("transfer", "transfer+stream"))
            parts.append(f"computes the prefix of {n:,} tokens once for {sharers} agent(s)")
    elif strategy != TEXT_NOCACHE and timing.prefix_via == "reuse":
        parts.append(f"prefix cache on {timing.replica} serves {timing.prefill_reused_tokens:,} tokens")
    elif n:
        parts.append(f"computes its prefix of {n:,} tokens on {timing.replica} ({format_seconds(recompute_s)})")
    if task.upstream:
        gap = timing.first_token_s - max(result.agents[u].end_s for u in task.upstream)
        verb = "streams" if strategy in STREAMS else "waits for"
        parts.append(f"{verb} {', '.join(task.upstream)}: first token {format_seconds(gap)} after its last input")
    if strategy == "text":
        parts.append("text baseline: no strategy predicted faster")
    return "; ".join(parts) or "no prefix, no inputs"
