"""The planner (`aaflow.planner.search`) on hand-built profiles and the simulated clock (no Ray, no
engine): near-ties won by less work, sharing that never loses to text, slow links avoided and fast
ones used, large workflows searched by groups of interchangeable agents, the fall-back to text, and
the plan's explanation. The simulator's own timelines: test_costmodel_simulator.py."""

from __future__ import annotations

import json

import pytest

import aaflow.planner.search as planner_module
from aaflow.planner.search import (MAKESPAN_TIE, MIN_GAIN_OVER_TEXT, PER_AGENT_SEARCH_MAX, interchangeable_groups,
                                    plan_workflow)
from aaflow.planner.simulate import simulate
from aaflow.costmodel.hardware import ComputeProfile
from aaflow.costmodel.workflow_spec import WorkflowSpec
from tests.core.costmodel_specs import CPU, SMOLLM2, agent, cluster, hardware, uniform


@pytest.mark.parametrize("link_bytes_per_s, tie", [(1e9, True), (3e8, False)])
def test_near_equal_makespans_are_a_tie_won_by_less_work(link_bytes_per_s, tie):
    # Eight agents on one 2,000-token context, two replicas: recomputing it on both replicas is a
    # little faster than computing it once and transferring it, but does twice the work.
    c = ComputeProfile(0.01, 1e-3, 0.0, 0.05, 0.0, 0.0)
    spec = WorkflowSpec("shared", tuple(agent(f"q{i}", "ctx", 2000, 20, out=4) for i in range(8)))
    hw = hardware(c, link_bytes_per_s=link_bytes_per_s)
    recompute = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "recompute"))
    transfer = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "transfer"))
    assert recompute.makespan_s < transfer.makespan_s and recompute.total_busy_s > transfer.total_busy_s
    assert (transfer.makespan_s <= recompute.makespan_s * (1 + MAKESPAN_TIE)) == tie
    plan = plan_workflow(spec, cluster(2), hw, {"m": SMOLLM2})
    # text (prefix cache on) is recompute here: a plan is never predicted slower than text, so even
    # the tie with transfer, which would save work, does not admit it
    assert plan.predicted.makespan_s <= plan.baseline.makespan_s == recompute.makespan_s
    assert set(plan.decisions.values()) <= {"text", "recompute"}


def map_reduce(prefix_tokens: int = 4096) -> WorkflowSpec:
    reviewers = tuple(agent(f"r{i}", "paper", prefix_tokens, 20, out=64) for i in range(3))
    meta = agent("meta", "paper", prefix_tokens, "r0", 5, "r1", 5, "r2", 20, out=64)
    return WorkflowSpec("review", reviewers + (meta,))


def test_map_reduce_sharing_computes_fewer_prefill_tokens_and_the_plan_never_loses_to_text():
    spec = map_reduce()
    hw = hardware(CPU)
    text = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "text"))
    nocache = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "text-nocache"))
    for strategy in ("transfer", "transfer+stream"):
        shared = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, strategy))
        assert shared.prefill_tokens_computed < nocache.prefill_tokens_computed / 3, strategy
        assert shared.prefill_tokens_computed < text.prefill_tokens_computed * 0.6, strategy  # the doc once, not twice
        assert shared.bytes_moved == 4096 * SMOLLM2.kv_bytes_per_token  # one prefix copy to the other replica
    plan = plan_workflow(spec, cluster(2), hw, {"m": SMOLLM2})
    # against text with its prefix cache, sharing saves work but hardly time on 2 replicas here
    assert plan.predicted.makespan_s <= plan.baseline.makespan_s < nocache.makespan_s
    assert plan.baseline == text
    assert set(plan.alternatives) == {"recompute", "transfer", "stream", "transfer+stream"}
    assert set(plan.runner_up) == {a.name for a in spec.agents}
    json.dumps(plan.to_dict())


def assert_best_or_text(plan) -> None:
    """Text for everyone, where no uniform strategy is predicted MIN_GAIN_OVER_TEXT faster than
    text; otherwise as fast as every uniform strategy (within the search's MAKESPAN_TIE, where it
    prefers the plan that computes less) and that much faster than text."""
    best = min(r.makespan_s for r in plan.alternatives.values())
    margin = plan.baseline.makespan_s * (1 - MIN_GAIN_OVER_TEXT)
    if set(plan.decisions.values()) == {"text"}:
        assert best > margin
    else:
        assert plan.predicted.makespan_s <= min(best * (1 + MAKESPAN_TIE), margin) + 1e-9


def cross_fan_out() -> WorkflowSpec:
    """A root over a 4,096-token context read by six consumers sharing it: on two replicas the
    consumers spread over both (placement balances load against the prefix cache), so the other
    replica needs the context too: moved or recomputed."""
    root = agent("A", "P", 4096, 16, out=64)
    kids = tuple(agent(f"a{i}", "P", 4096, "A", 16, out=32) for i in range(6))
    return WorkflowSpec("cross", (root, *kids))


def test_planner_avoids_a_slow_link_and_uses_a_fast_one():
    spec = cross_fan_out()
    slow = plan_workflow(spec, cluster(2), hardware(CPU, link_bytes_per_s=1e6), {"m": SMOLLM2})
    fast = plan_workflow(spec, cluster(2), hardware(CPU, link_bytes_per_s=1e11, measured=True), {"m": SMOLLM2})
    assert slow.predicted.bytes_moved == 0
    assert not any(row[2] == "transfer" for row in slow.edges())
    assert fast.predicted.bytes_moved > 0
    assert any(row[2] == "transfer" for row in fast.edges())
    assert fast.predicted.makespan_s < fast.alternatives["recompute"].makespan_s
    for plan in (slow, fast):
        assert plan.predicted.makespan_s <= plan.baseline.makespan_s
        assert_best_or_text(plan)
    assert (slow.projection, fast.projection) == (True, False)
    assert "PROJECTION" not in fast.explain()


def pairs(n: int) -> WorkflowSpec:
    """n A -> B pairs; the As' prompts have two lengths, so there are two kinds of A and of B."""
    tasks = []
    for i in range(n):
        tasks.append(agent(f"A{i}", "hdr", 8, 12 + i % 2, out=32))
        tasks.append(agent(f"B{i}", "sys", 1600, 4, f"A{i}", 9, out=8))
    return WorkflowSpec("pairs", tuple(tasks))


def test_agents_are_grouped_by_model_prefix_segments_output_and_upstream_groups():
    groups = interchangeable_groups(pairs(4))
    assert groups == [["A0", "A2"], ["B0", "B2"], ["A1", "A3"], ["B1", "B3"]]
    odd = WorkflowSpec("odd", pairs(2).agents + (agent("C", "sys", 1600, 4, "A0", 9, out=9),))
    assert ["C"] in interchangeable_groups(odd)  # another output length: its own group


def test_a_large_workflow_is_searched_by_groups(monkeypatch):
    calls = []
    real = planner_module.simulate
    monkeypatch.setattr(planner_module, "simulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = pairs(PER_AGENT_SEARCH_MAX)  # twice the per-agent limit
    plan = plan_workflow(spec, cluster(2), hardware(CPU), {"m": SMOLLM2})
    for group in interchangeable_groups(spec):
        assert len({plan.decisions[name] for name in group}) == 1
        assert len({plan.runner_up[name] for name in group}) == 1
    assert_best_or_text(plan)
    assert len(calls) < 100  # per agent, one pass alone would simulate 4 x 64 assignments


def test_plan_falls_back_to_text_when_nothing_beats_it():
    # Two agents on contexts of their own: a shared prefix has nobody to share it with, and
    # materializing it then forking it costs two calls more than text's one prefill.
    spec = WorkflowSpec("apart", (agent("A", "P", 4096, 16, out=8), agent("B", "Q", 4096, 16, out=8)))
    plan = plan_workflow(spec, cluster(2), hardware(CPU), {"m": SMOLLM2}, candidates=("transfer",))
    assert plan.alternatives["transfer"].makespan_s > plan.baseline.makespan_s
    assert set(plan.decisions.values()) == {"text"}
    assert plan.predicted == plan.baseline


def test_explain_names_every_agent_and_flags_projection():
    spec = map_reduce(2048)
    plan = plan_workflow(spec, cluster(2), hardware(CPU), {"m": SMOLLM2})
    text = plan.explain()
    assert "PROJECTION (not measured here)" in text and "test-box" in text
    for a in spec.agents:
        assert any(line.startswith(a.name + " ") for line in text.splitlines()), a.name
    edges = plan.edges()
    assert ("r0", "meta", "stream" if plan.decisions["meta"] in ("stream", "transfer+stream") else "wait") in edges
    assert sum(1 for p, _, _ in edges if p == "prefix:paper") == 4


def test_a_predicted_gain_within_the_margin_keeps_text(monkeypatch):
    spec = pairs(PER_AGENT_SEARCH_MAX)
    plan = plan_workflow(spec, cluster(2), hardware(CPU), {"m": SMOLLM2})
    gain = 1 - min(r.makespan_s for r in plan.alternatives.values()) / plan.baseline.makespan_s
    assert 0 < gain < MIN_GAIN_OVER_TEXT  # faster, but within the simulator's error
    assert set(plan.decisions.values()) == {"text"} and plan.predicted == plan.baseline
    monkeypatch.setattr(planner_module, "MIN_GAIN_OVER_TEXT", gain / 2)
    bolder = plan_workflow(spec, cluster(2), hardware(CPU), {"m": SMOLLM2})
    assert set(bolder.decisions.values()) != {"text"} and bolder.predicted.makespan_s < plan.baseline.makespan_s
