"""A predicted run: the scheduler (`aaflow.runtime.scheduler`) on the simulated clock.

A `WorkflowSpec` has token counts, not tokens: each agent gets synthetic token ids, equal where
the spec says the tokens are equal (one static prefix per `prefix_key` and model), distinct
elsewhere, so the prefix cache and packing see what they would see in a run. Every agent
generates exactly `output_tokens` (no early end-of-sequence).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from aaflow.engine.sampling import SamplingParams
from aaflow.common.errors import CostModelError
from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.prefix_key import PrefixIds
from aaflow.runtime.prompts import AgentInput
from aaflow.runtime.scheduler import Scheduler
from aaflow.runtime.sim_backend import SimBackend
from aaflow.common.strategies import STRATEGIES

if TYPE_CHECKING:
    from aaflow.costmodel.hardware import HardwareProfile
    from aaflow.costmodel.model_profile import ModelProfile
    from aaflow.costmodel.workflow_spec import ClusterSpec, WorkflowSpec

__all__ = ["STRATEGIES", "AgentTiming", "SimResult", "simulate"]


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
    """Predict a run of `spec` on `cluster` with one strategy per agent (names from `STRATEGIES`).
    Raises CostModelError naming the agent for an unknown strategy, model or unserved model."""
    cluster.check_serves(spec)
    for task in spec.agents:
        strategy = strategies.get(task.name)
        if strategy not in STRATEGIES:
            raise CostModelError(f"agent {task.name!r}: strategy {strategy!r} is not one of {STRATEGIES}")
        if task.model not in models:
            raise CostModelError(f"agent {task.name!r}: no ModelProfile for model {task.model!r}; "
                                 f"profiles given: {sorted(models)}")
    used = set(spec.models())
    backend = SimBackend([(name, model) for name, model in cluster.replicas if model in used], hardware, models,
                         cluster.link, call_overhead_s, cluster.block_tokens)
    agents = spec_agents(spec, strategies)
    collecting = gc.isenabled()
    gc.disable()  # a run allocates many small objects and little cyclic garbage: collecting it costs a third
    scheduler = Scheduler(agents, backend, {m: set() for m in used}, chunk_tokens=cluster.chunk_tokens)
    try:
        scheduler.run()
        timings = {a.name: AgentTiming(a.start_s, a.result.first_token_s, a.end_s, a.replica,
                                       a.result.prefill_computed, a.result.prefill_reused, a.strategy, a.prefix_via)
                   for a in agents.values()}
        return SimResult(backend.now(), timings, dict(backend.busy_s), backend.prefill_tokens_computed,
                         backend.bytes_moved, backend.peak_kv_bytes)
    finally:
        scheduler.dispose()  # freed here: what the collector sees when it is enabled again stays small
        if collecting:
            gc.enable()


def spec_agents(spec: WorkflowSpec, strategies: dict[str, str]) -> dict[str, AgentState]:
    """The spec's agents as scheduler state, with synthetic token ids; `planned` as in a run that
    follows a plan (a prefix may be computed rather than moved where the cost model says so)."""
    return {name: AgentState(name, task.model, strategies[name], list(segments), list(consumers), task.output_tokens,
                             sampling, ignore_eos=True, planned=True)
            for task, (name, segments, consumers, sampling) in zip(spec.agents, _synthetic(spec))}


@lru_cache(maxsize=4)  # the planner simulates one spec many times
def _synthetic(spec: WorkflowSpec) -> list[tuple]:
    """Per agent: (name, prompt segments with synthetic ids, consumers, sampling)."""
    used = [0]  # ids handed out so far
    prefixes: dict[tuple[str, str], tuple[int, ...]] = {}

    def fresh(n: int) -> tuple[int, ...]:
        start = used[0]
        used[0] += n
        return tuple(range(start, start + n))

    out = []
    for task in spec.agents:
        key = (task.model, task.prefix_key)
        if key not in prefixes:
            prefixes[key] = PrefixIds(fresh(task.prefix_tokens))  # one object for every agent and run: hashed once
        segments = (prefixes[key],) + tuple(AgentInput(s) if isinstance(s, str) else fresh(s) for s in task.segments)
        out.append((task.name, segments, tuple(spec.consumers(task.name)),
                    SamplingParams(max_new_tokens=task.output_tokens, ignore_eos=True)))
    return out
