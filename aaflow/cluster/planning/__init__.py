"""`af.plan(workflow, cluster)`: the cost-model planner applied to a real workflow and cluster.

The workflow becomes a `WorkflowSpec` (token counts from the same prompt builder the executor
uses; an upstream agent counts at its `max_tokens`), the cluster a `ClusterSpec`, and the
hardware profile is this machine's calibrated one (calibrated on first use), or any other
profile by name for a projection (`hardware="a100-80gb"`), always labelled as such.

Layer: cluster.
"""

from __future__ import annotations

import hashlib
import os
import threading
from array import array
from pathlib import Path
from typing import Callable

from aaflow.cluster.calibration import ensure_profile
from aaflow.engine.dtypes import resolve_dtype
from aaflow.common.errors import AAFlowError, CostModelError
from aaflow.models import resolve_model_path
from aaflow.planner.search import plan_workflow
from aaflow.runtime import check_sizes, prompt_builders
from aaflow.runtime.prefix_costs import PrefixCosts
from aaflow.runtime.prompts import AgentInput, static_prefix
from aaflow.common.strategies import DEFAULT_BLOCK_TOKENS
from aaflow.cluster.replica_api import default_transport
from aaflow.cluster.transports.emulated import parse_link_spec
from aaflow.costmodel.hardware import HardwareProfile, LinkProfile, load_hardware
from aaflow.costmodel.model_profile import ModelProfile
from aaflow.costmodel.profile_store import covers, find_profile, model_key
from aaflow.costmodel.workflow_spec import AgentTask, ClusterSpec, WorkflowSpec


def workflow_spec(workflow, builders: dict) -> WorkflowSpec:
    """Token counts of every agent's prompt segments, as the executor will feed them."""
    tasks = []
    for node in workflow.agents():
        segments = builders[node.model].segments(workflow, node)
        prefix = static_prefix(segments)
        key = hashlib.sha256(node.model.encode() + b"\0" + array("q", prefix).tobytes()).hexdigest()[:16]
        rest = tuple(s.agent if isinstance(s, AgentInput) else len(s) for s in segments[1:])
        tasks.append(AgentTask(node.name, node.model, key, len(prefix), rest, node.max_tokens))
    return WorkflowSpec(workflow.name, tuple(tasks))


def replica_infos(cluster, dtype: str = "auto") -> dict[str, dict]:
    """Per model: what sets its speed (model folder, dtype, threads). From the live replicas of a
    `Cluster`, or, for a plan made without starting one, from `{model: replicas}` and what
    `af.init(dtype=dtype)` would use (`dtype` resolved on this CPU, the CPUs shared equally).
    Raises `CostModelError` when a live cluster's replicas run another dtype than a named one."""
    if isinstance(cluster, dict):
        threads = max(1, (os.cpu_count() or 1) // sum(cluster.values()))
        return {m: {"model": m, "model_path": str(resolve_model_path(m, quiet=True)), "dtype": resolve_dtype(dtype),
                    "threads": threads} for m in cluster}
    infos = {m: cluster.info[cluster.replicas(m)[0].name] for m in cluster.models}  # read when the replicas started
    running = {i["dtype"] for i in infos.values()}
    if dtype != "auto" and running != {resolve_dtype(dtype)}:
        raise CostModelError(f"the cluster's replicas run {', '.join(sorted(running))}, not {dtype}: plan with "
                             "dtype='auto' (the replicas' own), or start the cluster with af.init(dtype=...)")
    return infos


def replica_names(cluster) -> tuple[tuple[str, str], ...]:
    """(replica, model) pairs in cluster order (the names `af.init` gives when planning offline)."""
    if isinstance(cluster, dict):
        return tuple((f"{m}-{i}", m) for m, n in cluster.items() for i in range(n))
    return tuple((r.name, r.model) for r in cluster.replicas())


def model_profiles(infos: dict[str, dict]) -> dict[str, ModelProfile]:
    """Each served model's shape, named by its compute-entry key (model, dtype, threads)."""
    return {m: ModelProfile.from_folder(model_key(i), Path(i["model_path"]), dtype=i["dtype"])
            for m, i in infos.items()}


def resolve_hardware(cluster, infos: dict[str, dict], hardware: str | HardwareProfile | None,
                     progress: Callable[[str], None] | None) -> HardwareProfile:
    """A profile object: given, loaded by name or path, or this machine's (calibrated on first use,
    which needs a live cluster)."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware is not None:
        return load_hardware(hardware)
    if not isinstance(cluster, dict):
        return ensure_profile(cluster, progress=progress, infos=infos)
    found = find_profile()
    if not covers(found, infos):
        raise CostModelError("this machine has no calibrated profile for these models; run `aaflow calibrate` "
                             "(or pass a live cluster, which calibrates on first use, or --hardware NAME)")
    return found


def machine_prefix_costs(cluster) -> PrefixCosts | None:
    """This machine's calibrated costs of moving and computing prefixes on `cluster`'s replicas
    (`PrefixCosts`), or None while it has no profile covering them (nothing is calibrated here)."""
    infos = replica_infos(cluster)
    profile = find_profile()
    if not covers(profile, infos):
        return None
    return PrefixCosts.of(profile, model_profiles(infos), default_link(profile, cluster))


def with_emulated_link(profile: HardwareProfile, link: str) -> HardwareProfile:
    """Add an emulated link ("ray@100Mbps,1ms": the real `ray` link capped) to the profile under its
    own name. The emulator caps only the fetch, while the real link's time also covers the gather
    on the source and the import on the destination, so the two add up: seconds per byte and
    latencies are summed (the fetch itself, a small part of the real time, is counted twice)."""
    if "@" not in link or link in profile.links:
        return profile

    base, bandwidth, latency = parse_link_spec(link)
    real = profile.links.get(base, LinkProfile(float("inf"), 0.0))
    combined = 1 / (1 / bandwidth + 1 / real.bandwidth_bytes_per_s)
    return profile.with_link(link, LinkProfile(combined, real.latency_s + latency))


def default_link(profile: HardwareProfile, cluster) -> str:
    """The link a plan assumes when none is named: the transport a run on `cluster` defaults to
    (`aaflow.cluster.replica_api.default_transport`) where the profile has it, else its "ray", else its first."""
    engines = {"builtin"} if isinstance(cluster, dict) else {r.engine for r in cluster.replicas()}
    try:
        transport = default_transport(engines)
    except AAFlowError:  # no transport runs here (a projection can still be planned)
        transport = None
    if transport in profile.links:
        return transport
    return "ray" if "ray" in profile.links else next(iter(profile.links), "ray")


def plan(workflow, cluster, hardware: str | HardwareProfile | None = None, link: str | None = None,
         chunk_tokens: int = 16, transport: str | None = None, progress: Callable[[str], None] | None = print,
         dtype: str = "auto"):
    """Plan `workflow` on `cluster`: the strategy per agent and edge, predicted times and memory.

    Args:
        cluster: a live `Cluster`, or `{model: replicas}` to plan without starting one.
        hardware: None for this machine's calibrated profile (measured; calibrated on first use),
            or a profile name / YAML path (e.g. "a100-80gb") to project onto other hardware.
        link: the link between replicas: a profile link name ("ray", "nixl", "ib-400g") or a
            bandwidth such as "25Gbps" (default: `transport`, else `default_link`: the transport
            `af.run` would use where the profile has it).
        chunk_tokens: the executor's streaming chunk size.
        dtype: planning without a cluster, the dtype the replicas would run ("auto": what
            `af.init` picks on this CPU); a live cluster's replicas report their own.
    Returns a `aaflow.planner.plans.Plan`; `print(plan.explain())` shows why each choice was made.
    """
    workflow.validate(served_models={m for _, m in replica_names(cluster)})
    builders, _, limits = prompt_builders({a.model for a in workflow.agents()})
    check_sizes(workflow, builders, limits)
    return plan_checked(workflow, cluster, builders, hardware, link, chunk_tokens, transport, progress, dtype)


def plan_checked(workflow, cluster, builders: dict, hardware: str | HardwareProfile | None = None,
                 link: str | None = None, chunk_tokens: int = 16, transport: str | None = None,
                 progress: Callable[[str], None] | None = print, dtype: str = "auto"):
    """`plan` for a workflow already validated against `cluster`, with its prompt builders
    (`af.run` has both when it plans for `strategy="auto"`)."""
    infos = replica_infos(cluster, dtype)
    profile = resolve_hardware(cluster, infos, hardware, progress)
    link = link or transport or default_link(profile, cluster)
    profile = with_emulated_link(profile, link)
    spec = workflow_spec(workflow, builders)
    blocks = {i["block_size"] for i in infos.values() if i.get("block_size")}
    cspec = ClusterSpec(replica_names(cluster), link=link, chunk_tokens=chunk_tokens,
                        block_tokens=min(blocks, default=DEFAULT_BLOCK_TOKENS))
    models = model_profiles(infos)
    key = repr((spec, cspec, profile, models))  # everything the search reads: the same plan comes out
    with _PLANS_LOCK:
        plan = _PLANS.pop(key, None)
    plan = plan or plan_workflow(spec, cspec, profile, models, call_overhead_s=profile.call_overhead_s or 0.002)
    with _PLANS_LOCK:  # runs from several threads share the memo
        _PLANS[key] = plan  # the most recent last
        while len(_PLANS) > PLAN_MEMO_SIZE:
            _PLANS.pop(next(iter(_PLANS)))
    return plan


# Plans already searched in this process, by their inputs: a workflow run again (the same prompts'
# token counts, the same cluster and profile) is not planned again (the planner is deterministic,
# and a search is a visible share of a short run: docs/RESULTS-history.md).
PLAN_MEMO_SIZE = 16
_PLANS: dict[str, object] = {}
_PLANS_LOCK = threading.Lock()
