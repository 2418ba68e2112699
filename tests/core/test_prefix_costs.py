"""Move or compute (aaflow/runtime/prefix_costs.py): a replica lacking a shared prefix has it moved
from where it is (or will be) unless the cost model says computing it there ends sooner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aaflow.runtime.calls import ExposeCall, MaterializeCall
from aaflow.runtime.prefix_costs import PrefixCosts
from aaflow.runtime.prefix_key import PlacedPrefix, PrefixKey
from aaflow.runtime.prefix_sharing import PrefixSharing
from aaflow.runtime.scheduler_state import SchedulerState
from aaflow.costmodel.hardware import ComputeProfile, LinkProfile

PREFIX = PrefixKey("m", tuple(range(1000)), None)
KV_BYTES_PER_TOKEN = 10_000  # 10 MB for the prefix
COMPUTE = ComputeProfile(prefill_fixed_s=0.0, prefill_s_per_token=1e-3, prefill_s_per_token_ctx=0.0,
                         decode_fixed_s=0.0, decode_s_per_seq=0.0, decode_s_per_seq_ctx=0.0)  # 1 s for the prefix


def _costs(bytes_per_s: float, slowdown: float = 1.5, lent: float = 1.0) -> PrefixCosts:
    return PrefixCosts({"m": COMPUTE}, {"m": KV_BYTES_PER_TOKEN}, LinkProfile(bytes_per_s), 1e12, slowdown, lent)


def _sharing(costs: PrefixCosts | None, now: float = 0.0) -> tuple[PrefixSharing, list]:
    calls: list = []
    queues = SimpleNamespace(replicas=["r0", "r1"], call=lambda replica, call, then=None: calls.append((replica, call)),
                             now=lambda: now)
    backend = SimpleNamespace(replicas=lambda: [], now=lambda: now, prefix_costs=lambda: costs)
    return PrefixSharing(SchedulerState(backend), queues, "ray", forked=lambda agent, n: None), calls


def _needs_it_on_r1(sharing: PrefixSharing, planned: bool = True) -> None:
    sharing.fork_into(SimpleNamespace(name="reader", replica="r1", planned=planned), PREFIX)


def test_the_costs_weigh_a_move_against_a_prefill():
    costs = _costs(100e6)  # 0.1 s to move, 1 s to compute
    assert costs.move_s("m", 1000) == pytest.approx(0.1, rel=1e-3) and costs.compute_s("m", 1000) == 1.0
    assert not costs.compute_here("m", 1000, 0.0)  # held: move
    assert not costs.compute_here("m", 1000, 0.5)  # half computed: wait and move
    assert not costs.compute_here("m", 1000, 0.95)  # computing here is sooner, but not by 10%
    assert costs.compute_here("m", 1000, 2.0)  # the holder is 2 s away from having it
    assert not costs.compute_here("other", 1000, 9.0)  # a model it has no figures for: move
    assert costs.ready_in_s("m", 1000, 0.25) == pytest.approx(0.75)
    assert _costs(100e6, lent=2.0).ready_in_s("m", 1000, 0.25) == pytest.approx(0.25)  # the waiting replicas lend their cores


def test_a_held_prefix_is_moved_over_a_fast_link_and_computed_where_the_link_is_slow():
    fast, calls = _sharing(_costs(100e6))
    fast.refs[PREFIX] = {"r0": "ref0"}
    _needs_it_on_r1(fast)
    assert calls == [("r0", ExposeCall("ref0", "ray"))]
    slow, calls = _sharing(_costs(1e6))  # 10 s to move, 1 s to compute
    slow.refs[PREFIX] = {"r0": "ref0"}
    _needs_it_on_r1(slow)
    assert calls == [("r1", MaterializeCall(list(PREFIX.ids)))]
    assert PlacedPrefix(PREFIX, "r1") in slow.computing_here and "sooner than moving it" in slow.state.events[0]


def test_a_prefix_still_being_computed_elsewhere_is_waited_for_unless_computing_it_here_is_sooner():
    waiting, calls = _sharing(_costs(100e6), now=0.2)  # r0 started at 0: 0.8 s left, then 0.1 s to move
    waiting.origin[PREFIX], waiting.origin_since[PREFIX] = "r0", 0.0
    _needs_it_on_r1(waiting)
    assert calls == [] and list(waiting.waiters) == [PlacedPrefix(PREFIX, "r1")]
    waiting._ready(PREFIX, "r0", "ref0", 0, received=False)  # r0 has it: r1's waiter gets it moved
    assert calls == [("r0", ExposeCall("ref0", "ray"))]
    computing, calls = _sharing(_costs(1e6), now=0.2)  # 10 s to move: compute here at once
    computing.origin[PREFIX], computing.origin_since[PREFIX] = "r0", 0.0
    _needs_it_on_r1(computing)
    assert calls == [("r1", MaterializeCall(list(PREFIX.ids)))]
    computing._ready(PREFIX, "r0", "ref0", 0, received=False)  # r0's copy is not also sent to r1
    assert calls == [("r1", MaterializeCall(list(PREFIX.ids)))]


def test_without_a_profile_or_under_a_strategy_the_user_named_a_prefix_is_always_moved():
    sharing, calls = _sharing(None)
    sharing.refs[PREFIX] = {"r0": "ref0"}
    _needs_it_on_r1(sharing)
    assert calls == [("r0", ExposeCall("ref0", "ray"))]
    named, calls = _sharing(_costs(1e6))  # computing would be sooner, but the user asked for "transfer"
    named.refs[PREFIX] = {"r0": "ref0"}
    _needs_it_on_r1(named, planned=False)
    assert calls == [("r0", ExposeCall("ref0", "ray"))]


def test_the_simulated_clock_weighs_the_same_costs():
    """Six agents sharing one prefix on two replicas under `transfer`: over a fast link the second
    replica receives the prefix; over a link so slow that moving it costs more than its prefill, it
    computes it itself, and the run ends sooner than it would waiting for the move."""
    from aaflow.planner.simulate import simulate
    from aaflow.costmodel.hardware import HardwareProfile
    from aaflow.costmodel.model_profile import ModelProfile
    from aaflow.costmodel.workflow_spec import AgentTask, ClusterSpec, WorkflowSpec

    model = ModelProfile("m", layers=30, kv_heads=3, head_dim=64, num_heads=9, params=135_000_000)
    compute = ComputeProfile(0.005, 1e-4, 1e-8, 0.02, 1e-4, 1e-7)  # 0.2 s for the 2,000-token prefix
    spec = WorkflowSpec("fan", tuple(AgentTask(f"g{i}", "m", "doc", 2000, (8,), 8) for i in range(6)))
    replicas = ClusterSpec((("s0", "m"), ("s1", "m")))
    runs = {}
    for name, bytes_per_s in (("fast", 5e9), ("slow", 1e8)):  # the 46 MB prefix: 9 ms, or 0.46 s
        hardware = HardwareProfile("box", False, "hand-built", 2e10, {"m": compute}, {"ray": LinkProfile(bytes_per_s)},
                                   concurrency_slowdown=1.3)
        runs[name] = simulate(spec, replicas, hardware, {"m": model}, {a.name: "transfer" for a in spec.agents})
    fast_via = {t.prefix_via for t in runs["fast"].agents.values()}
    slow_via = {t.prefix_via for t in runs["slow"].agents.values()}
    assert "transfer" in fast_via and runs["fast"].bytes_moved > 0
    assert "transfer" not in slow_via and runs["slow"].bytes_moved == 0
    assert runs["slow"].prefill_tokens_computed >= runs["fast"].prefill_tokens_computed + 2000
