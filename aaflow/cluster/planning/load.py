"""Predicting a load: many workflows arriving on one cluster, run on the simulated clock by the
scheduler the cluster's loop runs (`aaflow.runtime.scheduler.Scheduler` over `SimBackend`), each
workflow's agents under its own run prefix as `RunService` names them. Call costs come from the
calibrated hardware profile, as `af.plan`'s; a run joins at the end of the call in flight when it
arrives (the loop takes new runs between two replica calls)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from aaflow.common.errors import WorkflowError
from aaflow.cluster.planning import (default_link, model_profiles, plan_checked, replica_infos, replica_names, resolve_hardware,
                             with_emulated_link)
from aaflow.runtime import check_sizes, prompt_builders
from aaflow.runtime.agent_state import namespaced
from aaflow.runtime.executor import workflow_agents
from aaflow.runtime.scheduler import AWAIT_POLL_S, Scheduler, Turn
from aaflow.runtime.sim_backend import SimBackend


@dataclass
class LoadPrediction:
    """Predicted seconds: each workflow's latency (arrival to its last agent's last token), the
    load's wall (first arrival to last end), and the figures `aaflow bench serve` reports."""

    latencies_s: dict[str, float]
    wall_s: float
    strategy: str
    busy_s: dict[str, float] = field(default_factory=dict)  # per replica
    turns: int = 0  # replica calls the loop handed on
    loop_cpu_s: float = 0.0  # CPU seconds of the loop: the scheduler deciding, and the simulated replicas' bookkeeping

    @property
    def workflows_per_min(self) -> float:
        return 60.0 * len(self.latencies_s) / self.wall_s if self.wall_s else 0.0

    @property
    def latency_p50_s(self) -> float:
        return statistics.median(self.latencies_s.values())

    @property
    def latency_p99_s(self) -> float:
        ordered = sorted(self.latencies_s.values())
        return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


def plan_load(workflows: list, cluster, arrivals_s: list[float] | None = None, strategy: str = "text",
              hardware=None, link: str | None = None, chunk_tokens: int = 16, dtype: str = "auto",
              progress: Callable[[str], None] | None = print) -> LoadPrediction:
    """Predict `workflows` (workflow i arriving `arrivals_s[i]` seconds after the first; all at once
    by default) on `cluster` (a live `Cluster` or `{model: replicas}`), every agent under `strategy`
    ("auto": each workflow's plan from `af.plan`). `hardware`, `link`, `dtype` as `af.plan` takes them."""
    if not workflows:
        raise WorkflowError("plan_load needs at least one workflow")
    arrivals = [0.0] * len(workflows) if arrivals_s is None else [float(a) for a in arrivals_s]
    if len(arrivals) != len(workflows) or any(a < 0 for a in arrivals):
        raise WorkflowError(f"arrivals_s: {len(arrivals)} offsets >= 0 needed, one per workflow ({len(workflows)})")
    models = {a.model for wf in workflows for a in wf.agents()}
    builders, eos, limits = prompt_builders(models)
    for wf in workflows:
        wf.validate(served_models={m for _, m in replica_names(cluster)})
        check_sizes(wf, builders, limits)
    infos = replica_infos(cluster, dtype)
    profile = resolve_hardware(cluster, infos, hardware, progress)
    link = link or default_link(profile, cluster)
    profile = with_emulated_link(profile, link)
    backend = SimBackend([(n, m) for n, m in replica_names(cluster) if m in models], profile,
                         model_profiles(infos), link, profile.call_overhead_s or 0.002)
    scheduler = Scheduler({}, backend, {m: set() for m in models}, chunk_tokens=chunk_tokens)
    order = sorted(range(len(workflows)), key=lambda i: arrivals[i])
    runs: dict[int, dict] = {}
    turns, cpu_before = 0, time.thread_time()
    try:
        while order or scheduler.unfinished:
            while order and arrivals[order[0]] <= backend.now():
                i = order.pop(0)
                runs[i] = namespaced(workflow_agents(workflows[i], builders, strategy, _decisions(
                    workflows[i], cluster, builders, strategy, hardware, link, chunk_tokens, dtype)), f"w{i}/")
                scheduler.add(runs[i])
            turn = scheduler.turn(3600.0)
            turns += turn is Turn.RAN
            if turn is Turn.AWAITING:  # a replica to come back (none dies on the simulated clock)
                backend.pause(AWAIT_POLL_S)
            elif turn is Turn.STALLED and order:  # idle until the next arrival
                backend.pause(arrivals[order[0]] - backend.now())
            elif turn is Turn.STALLED and scheduler.unfinished or turn is Turn.TIMED_OUT:
                raise WorkflowError("the simulated load stalled: agents left that cannot run")
    finally:
        busy = dict(backend.busy_s)
        loop_cpu = time.thread_time() - cpu_before
        scheduler.dispose()
    latencies = {f"{i}:{workflows[i].name}": max(a.end_s for a in agents.values()) - arrivals[i]
                 for i, agents in runs.items()}
    first = min(arrivals)
    wall = max(arrivals[i] + lat for i, lat in zip(runs, latencies.values())) - first
    return LoadPrediction(latencies, wall, strategy, busy, turns, loop_cpu)


def _decisions(workflow, cluster, builders, strategy: str, hardware, link, chunk_tokens: int, dtype: str):
    """Under "auto", the workflow's plan decisions (memoized by `plan_checked`); else None."""
    if strategy != "auto":
        return None

    return plan_checked(workflow, cluster, builders, hardware, link, chunk_tokens, progress=None, dtype=dtype).decisions
