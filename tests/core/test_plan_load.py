"""`af.plan_load`: a load of workflows predicted on the simulated clock by the cluster loop's
scheduler (aaflow/cluster/planning/load.py)."""

from __future__ import annotations

import pytest

import aaflow as af
from tests.frontend.test_workflow_run import map_reduce

SETTINGS = dict(hardware="a100-80gb", link="25Gbps", progress=None)


def test_runs_far_apart_take_what_each_takes_alone_and_a_burst_is_batched(tiny_llama_dir):
    model = str(tiny_llama_dir)
    cluster = {model: 1}
    alone = af.plan_load([map_reduce(model)], cluster, **SETTINGS)
    (one,) = alone.latencies_s.values()
    apart = af.plan_load([map_reduce(model) for _ in range(3)], cluster, arrivals_s=[0.0, 1000.0, 2000.0], **SETTINGS)
    first, *later = apart.latencies_s.values()
    assert first == pytest.approx(one)  # alone on an idle cluster
    assert all(lat < one for lat in later)  # alone too, but the document is in the replica's prefix cache
    assert apart.wall_s == pytest.approx(2000.0 + one)
    burst = af.plan_load([map_reduce(model) for _ in range(4)], cluster, **SETTINGS)
    assert len(burst.latencies_s) == 4 and all(lat >= one * 0.999 for lat in burst.latencies_s.values())
    assert burst.wall_s < 4 * one  # one loop batches the four runs: less than one after another
    assert burst.latency_p99_s >= burst.latency_p50_s > 0 and burst.workflows_per_min > 0
    assert burst.turns >= len(apart.latencies_s) and burst.loop_cpu_s > 0  # the loop's own cost is reported


def test_a_load_under_auto_follows_each_workflows_plan(tiny_llama_dir):
    model = str(tiny_llama_dir)
    auto = af.plan_load([map_reduce(model) for _ in range(2)], {model: 2}, strategy="auto", **SETTINGS)
    assert auto.strategy == "auto" and len(auto.latencies_s) == 2 and auto.wall_s > 0


def test_bad_arrivals_are_refused(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with pytest.raises(af.WorkflowError, match="arrivals_s"):
        af.plan_load([map_reduce(model)], {model: 1}, arrivals_s=[0.0, 1.0], **SETTINGS)
    with pytest.raises(af.WorkflowError, match="at least one"):
        af.plan_load([], {model: 1}, **SETTINGS)
