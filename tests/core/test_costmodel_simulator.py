"""The scheduler on the simulated clock (`aaflow.planner.simulate`), on hand-built profiles (no Ray,
no engine): hand-computed timelines of one agent, a streamed chain, fan-outs and packed prefills, a
move slower than a prefill, prefills on lent cores, and errors that name the agent. The planner that
searches over it: test_costmodel_planner.py."""

from __future__ import annotations

import pytest

from aaflow.common.errors import CostModelError
from aaflow.planner.search import MAKESPAN_TIE
from aaflow.planner.simulate import simulate
from aaflow.costmodel.hardware import ComputeProfile, HardwareProfile
from aaflow.costmodel.workflow_spec import AgentTask, WorkflowSpec
from tests.core.costmodel_specs import CPU, SMOLLM2, agent, cluster, hardware, uniform

O = 0.002  # the simulator's default call overhead (s)


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
