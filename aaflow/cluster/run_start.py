"""Starting a run on a scheduling loop of this process (`af.start` on a local cluster, and a
deployment's actor for its clients): check the workflow against the cluster, plan it, build its
agents and hand them to the cluster's loop."""

from __future__ import annotations

import time

from aaflow.common.errors import AAFlowError
from aaflow.cluster.planning import plan_checked
from aaflow.runtime.executor import workflow_agents
from aaflow.runtime.kvops import check_replicas
from aaflow.runtime.prompt_setup import check_sizes, prompt_builders
from aaflow.runtime.run_handle import RunHandle
from aaflow.runtime.run_options import RunOptions
from aaflow.cluster.ray_backend import service_for


def start_here(workflow, cluster, strategy: str, chunk_tokens: int, call_timeout_s: float, transport: str | None,
               plan, lend_cores: bool, timeout_s: float | None, on_token=None, on_agent=None,
               keep_prefix_s: float | None = None, prefix_fetch: str = "auto") -> RunHandle:
    """`start` on a loop of this process: check and plan the run here, then hand it over."""
    called = time.perf_counter()
    workflow.validate(served_models=cluster.models)
    check_replicas(workflow, {r.name for r in cluster.replicas()})
    builders, eos, limits = prompt_builders({a.model for a in workflow.agents()})
    check_sizes(workflow, builders, limits, cluster)
    events = []
    planning_s = 0.0
    if strategy == "auto" and plan is None:
        begun = time.perf_counter()
        try:
            plan = plan_checked(workflow, cluster, builders, chunk_tokens=chunk_tokens, transport=transport)
        except AAFlowError as exc:
            events.append(f"planner unavailable ({exc}); auto follows its documented rule")
        planning_s = time.perf_counter() - begun
    decisions = plan.decisions if strategy == "auto" and plan is not None else None
    if decisions:
        events.append(f"planner ({planning_s:.2f} s): " + ", ".join(f"{a}={s}" for a, s in decisions.items()))
    agents = workflow_agents(workflow, builders, strategy, decisions)
    options = RunOptions(chunk_tokens, call_timeout_s, transport, lend_cores, prefix_fetch)
    return service_for(cluster).submit(workflow, agents, builders, eos, strategy, events, on_token=on_token,
                                       on_agent=on_agent, timeout_s=timeout_s, planning_s=planning_s, called=called,
                                       keep_prefix_s=keep_prefix_s, options=options)
