"""The scheduler on the simulated clock and the planner, on hand-built profiles (no Ray, no engine)."""

from __future__ import annotations

import json

import pytest

from aaflow.errors import CostModelError
from costmodel.hardware import ComputeProfile, HardwareProfile, LinkProfile
from costmodel.model_profile import ModelProfile
import aaflow.planning.search as planner_module
from aaflow.planning.search import (MAKESPAN_TIE, MIN_GAIN_OVER_TEXT, PER_AGENT_SEARCH_MAX, interchangeable_groups,
                                    plan_workflow)
from aaflow.planning.simulate import simulate
from costmodel.workflow_spec import AgentTask, ClusterSpec, WorkflowSpec

O = 0.002  # the simulator's default call overhead (s)
SMOLLM2 = ModelProfile("m", layers=30, kv_heads=3, head_dim=64, num_heads=9, params=135_000_000)  # 23,040 B/token


def hardware(compute: ComputeProfile, link_bytes_per_s: float = 5e9, measured: bool = False) -> HardwareProfile:
    return HardwareProfile("test-box", measured, "hand-built", 2e10, {"m": compute},
                           {"ray": LinkProfile(link_bytes_per_s)})


def cluster(n: int) -> ClusterSpec:
    return ClusterSpec(tuple((f"s{i}", "m") for i in range(n)))


def agent(name: str, prefix_key: str, prefix_tokens: int, *segments, out: int = 8) -> AgentTask:
    return AgentTask(name, "m", prefix_key, prefix_tokens, tuple(segments), out)


def uniform(spec: WorkflowSpec, strategy: str) -> dict[str, str]:
    return {a.name: strategy for a in spec.agents}


# A CPU-like profile: 0.1 ms per prefill token, 20 ms per decode step.
CPU = ComputeProfile(prefill_fixed_s=0.005, prefill_s_per_token=1e-4, prefill_s_per_token_ctx=1e-8,
                     decode_fixed_s=0.02, decode_s_per_seq=1e-4, decode_s_per_seq_ctx=1e-7)


def test_single_agent_is_prefill_plus_decode_steps_plus_overheads():
    c = ComputeProfile(0.01, 0.001, 0.0, 0.02, 0.001, 1e-5)
    spec = WorkflowSpec("one", (agent("a", "doc", 100, 10, out=5),))
    r = simulate(spec, cluster(1), hardware(c), {"m": SMOLLM2}, {"a": "text"})
    prefill = 0.01 + 0.001 * 110
    # the 4 decode steps go as one group of steps (one call overhead); context grows one token per step
    steps = O + 4 * (0.02 + 0.001) + 1e-5 * (110 + 111 + 112 + 113)
    t = r.agents["a"]
    assert t.first_token_s == pytest.approx(O + O + prefill)  # session_open, session_prefill
    assert t.end_s == pytest.approx(2 * O + prefill + steps)
    assert r.makespan_s == pytest.approx(2 * O + prefill + steps + O)  # session_close
    assert r.busy_s["s0"] == pytest.approx(r.makespan_s)
    assert (t.prefill_computed_tokens, t.prefill_reused_tokens, r.prefill_tokens_computed) == (110, 0, 110)
    assert r.peak_kv_bytes == (110 + 4) * SMOLLM2.kv_bytes_per_token
    assert r.bytes_moved == 0


def test_chain_stream_hands_off_one_chunk_remainder():
    # A decodes 33 tokens on s0; B (on s1) prefills its prefix at once, A's tokens in chunks of 16 as
    # they come, and at A's end only A's last token + its 8-token tail.
    c = ComputeProfile(0.001, 1e-4, 0.0, 0.01, 0.001, 0.0)
    prefill = c.prefill_time
    step = O + c.decode_step_time(1)
    spec = WorkflowSpec("chain", (agent("A", "pa", 32, out=33), agent("B", "pb", 512, "A", 8, out=2)))
    hw = hardware(c)
    streamed = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "stream"))
    text = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "text"))

    a_end = 2 * O + prefill(32) + 32 * step  # A feeds a streaming reader: one step per call
    assert streamed.agents["A"].end_s == pytest.approx(a_end)
    text_a_end = 2 * O + prefill(32) + 4 * O + 32 * c.decode_step_time(1)  # text: 4 groups of 8 steps
    assert text.agents["A"].end_s == pytest.approx(text_a_end)
    s = streamed.agents["B"]
    assert (streamed.agents["A"].replica, s.replica) == ("s0", "s1")
    assert s.first_token_s - a_end == pytest.approx(O + prefill(1 + 8))
    assert streamed.makespan_s == pytest.approx(a_end + O + prefill(9) + step + O)
    # text: B opens after A, on s0 with A's close (sent together: one round trip), and prefills the whole prompt
    t = text.agents["B"]
    assert t.first_token_s - text_a_end == pytest.approx(2 * O + prefill(512 + 33 + 8))
    assert s.first_token_s - a_end < (t.first_token_s - text_a_end) / 5
    assert s.prefill_computed_tokens == t.prefill_computed_tokens == 512 + 33 + 8


def test_fan_out_on_one_replica_decodes_in_batches():
    # Steps cost 0.1 s whatever the batch: 4 children x 9 steps must cost 9 steps, not 36 (their
    # prompts run as one packed call, so they start decoding together).
    c = ComputeProfile(0.001, 0.001, 0.0, 0.1, 0.0, 0.0)
    kids = tuple(agent(f"c{i}", "c", 8, "R", out=10) for i in range(4))
    spec = WorkflowSpec("fan", (agent("R", "r", 8, out=4),) + kids)
    r = simulate(spec, cluster(1), hardware(c), {"m": SMOLLM2}, uniform(spec, "text"), call_overhead_s=0.0)
    packed = 4 * c.prefill_time(8 + 4) - 3 * c.prefill_fixed_s  # the children's prompts: one packed call
    expected = c.prefill_time(8) + 3 * 0.1 + packed + 9 * 0.1
    assert r.busy_s["s0"] == pytest.approx(expected)
    assert r.makespan_s == pytest.approx(expected)
    ends = sorted(r.agents[k.name].end_s for k in kids)
    assert ends[-1] - ends[0] < 4 * 0.1  # they finish together, not one after another


def test_a_pack_sharing_a_prefix_pays_a_second_pass():
    # Three agents open together on one replica: their prompts run as one packed call, in which the
    # first computes the shared 64-token prefix and the others reuse it in a second forward pass.
    c = ComputeProfile(0.01, 0.001, 0.0, 0.1, 0.0, 0.0)
    spec = WorkflowSpec("siblings", tuple(agent(n, "doc", 64, 4, out=1) for n in "abc"))
    r = simulate(spec, cluster(1), hardware(c), {"m": SMOLLM2}, uniform(spec, "recompute"), call_overhead_s=0.0)
    assert r.prefill_tokens_computed == 68 + 4 + 4
    assert r.busy_s["s0"] == pytest.approx(2 * 0.01 + 0.001 * 76)  # two passes, not three calls
    text = simulate(spec, cluster(1), hardware(c), {"m": SMOLLM2}, uniform(spec, "text-nocache"), call_overhead_s=0.0)
    assert text.busy_s["s0"] == pytest.approx(0.01 + 0.001 * 3 * 68)  # no reuse: one pass


def test_first_prompts_on_one_shared_prefix_pack_beyond_the_token_cap():
    # Twenty prompts of 1,004 tokens, 1,000 of them shared: the pack counts what each adds to compute
    # (4 tokens after the first), so all go in one call of two passes; without reuse, two per call.
    c = ComputeProfile(0.01, 0.001, 0.0, 0.1, 0.0, 0.0)
    spec = WorkflowSpec("siblings", tuple(agent(f"a{i}", "doc", 1000, 4, out=1) for i in range(20)))
    r = simulate(spec, cluster(1), hardware(c), {"m": SMOLLM2}, uniform(spec, "recompute"), call_overhead_s=0.0)
    computed = 1004 + 19 * (1004 - 992)  # 62 full blocks of 16 shared; the partial one is not
    assert r.prefill_tokens_computed == computed
    assert r.busy_s["s0"] == pytest.approx(2 * 0.01 + 0.001 * computed)  # one call, two passes
    text = simulate(spec, cluster(1), hardware(c), {"m": SMOLLM2}, uniform(spec, "text-nocache"), call_overhead_s=0.0)
    assert text.busy_s["s0"] == pytest.approx(10 * 0.01 + 0.001 * 20 * 1004)


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


def test_a_move_much_slower_than_a_prefill_is_not_made_the_second_replica_computes_the_context():
    # The same over a slow link: waiting for the context and moving it would end 20% later than
    # computing it on the second replica at once, so under "transfer" the scheduler computes it there
    # (aaflow/runtime/prefix_costs.py): nothing moves, and it ends with recompute.
    c = ComputeProfile(0.01, 1e-3, 0.0, 0.05, 0.0, 0.0)
    spec = WorkflowSpec("shared", tuple(agent(f"q{i}", "ctx", 2000, 20, out=4) for i in range(8)))
    hw = hardware(c, link_bytes_per_s=1e8)
    recompute = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "recompute"))
    transfer = simulate(spec, cluster(2), hw, {"m": SMOLLM2}, uniform(spec, "transfer"))
    assert transfer.bytes_moved == 0 and transfer.prefill_tokens_computed >= 2 * 2000
    assert transfer.makespan_s == pytest.approx(recompute.makespan_s, rel=MAKESPAN_TIE)


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


def test_errors_name_the_agent():
    with pytest.raises(CostModelError, match="'ghost'"):
        WorkflowSpec("bad", (agent("a", "p", 8), agent("b", "p", 8, "ghost")))
    with pytest.raises(CostModelError, match="cycle"):
        WorkflowSpec("loop", (agent("a", "p", 8, "b"), agent("b", "p", 8, "a")))
    spec = WorkflowSpec("w", (AgentTask("lonely", "other-model", "p", 8, (), 4),))
    with pytest.raises(CostModelError, match="'lonely'.*no replica"):
        simulate(spec, cluster(1), hardware(CPU), {"m": SMOLLM2}, {"lonely": "text"})
    spec = WorkflowSpec("w", (agent("a", "p", 8),))
    with pytest.raises(CostModelError, match="'a'.*'fastest'"):
        simulate(spec, cluster(1), hardware(CPU), {"m": SMOLLM2}, {"a": "fastest"})
    with pytest.raises(CostModelError, match="output_tokens"):
        agent("z", "p", 8, out=0)


def test_a_prefix_materialized_while_the_other_replica_idles_runs_on_lent_cores():
    # One replica materializes a 4,096-token prefix while the other waits for it (transfer):
    # with lent_core_speedup 2, that prefill takes half as long; two agents computing their own
    # prefixes on both replicas at once lend nothing (neither idles), and a short prefix
    # (< LEND_MIN_TOKENS) is never sped up.
    from dataclasses import replace

    from aaflow.runtime.core_lending import LEND_MIN_TOKENS

    c = ComputeProfile(0.0, 1e-3, 0.0, 0.02, 0.0, 0.0)
    hw, lending = hardware(c), replace(hardware(c), lent_core_speedup=2.0)
    spec = WorkflowSpec("pair", tuple(agent(f"q{i}", "ctx", 4096, 20, out=4) for i in range(2)))
    alone, lent = (simulate(spec, cluster(2), h, {"m": SMOLLM2}, uniform(spec, "transfer")) for h in (hw, lending))
    assert lent.makespan_s == pytest.approx(alone.makespan_s - 4096e-3 / 2, abs=0.01)
    apart = WorkflowSpec("apart", tuple(agent(f"q{i}", f"ctx{i}", 4096, 20, out=4) for i in range(2)))
    recompute = [simulate(apart, cluster(2), h, {"m": SMOLLM2}, uniform(apart, "recompute")) for h in (hw, lending)]
    assert recompute[0].makespan_s == recompute[1].makespan_s
    short = WorkflowSpec("short", tuple(agent(f"q{i}", "ctx", LEND_MIN_TOKENS - 64, 20, out=4) for i in range(2)))
    assert (simulate(short, cluster(2), hw, {"m": SMOLLM2}, uniform(short, "transfer")).makespan_s
            == simulate(short, cluster(2), lending, {"m": SMOLLM2}, uniform(short, "transfer")).makespan_s)


def test_lent_core_speedup_below_one_is_refused():
    with pytest.raises(CostModelError, match="lent_core_speedup"):
        HardwareProfile("box", True, "", 1e9, lent_core_speedup=0.5)


def test_a_predicted_gain_within_the_margin_keeps_text(monkeypatch):
    spec = pairs(PER_AGENT_SEARCH_MAX)
    plan = plan_workflow(spec, cluster(2), hardware(CPU), {"m": SMOLLM2})
    gain = 1 - min(r.makespan_s for r in plan.alternatives.values()) / plan.baseline.makespan_s
    assert 0 < gain < MIN_GAIN_OVER_TEXT  # faster, but within the simulator's error
    assert set(plan.decisions.values()) == {"text"} and plan.predicted == plan.baseline
    monkeypatch.setattr(planner_module, "MIN_GAIN_OVER_TEXT", gain / 2)
    bolder = plan_workflow(spec, cluster(2), hardware(CPU), {"m": SMOLLM2})
    assert set(bolder.decisions.values()) != {"text"} and bolder.predicted.makespan_s < plan.baseline.makespan_s
