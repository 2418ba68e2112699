"""Placement by predicted wait (aaflow/runtime/placement.py): a hot prefix's readers stay with its
holder until the holder's queue outweighs getting the prefix elsewhere (a move over a fast link,
its prefill over a slow one); without a profile, the least-loaded replica with a 1.5-agent bonus
for the holder. And the tally of how replicas got the prefixes they lacked, on the simulated clock."""

from __future__ import annotations

import pytest

from aaflow.runtime.agent_state import AgentState
from aaflow.runtime.kvops import KVDirective
from aaflow.runtime.placement import Placement, predicted_tokens
from aaflow.runtime.prefix_costs import PrefixCosts
from aaflow.runtime.prompts import AgentInput
from costmodel.hardware import ComputeProfile, LinkProfile

PREFIX = tuple(range(1000))  # 1 s to compute, 10 MB of KV
OWN = 200  # each reader's own prompt tokens: 0.2 s
COMPUTE = ComputeProfile(prefill_fixed_s=0.0, prefill_s_per_token=1e-3, prefill_s_per_token_ctx=0.0,
                         decode_fixed_s=0.0, decode_s_per_seq=0.0, decode_s_per_seq_ctx=0.0)


def _costs(bytes_per_s: float) -> PrefixCosts:
    return PrefixCosts({"m": COMPUTE}, {"m": 10_000}, LinkProfile(bytes_per_s), 1e12)


def _reader(i: int, replica: str | None = None) -> AgentState:
    return AgentState(f"r{i}", "m", "transfer", [PREFIX, tuple(range(OWN))], [], 0,
                      kv=KVDirective(share_prefix=True, replica=replica))


def _place(count: int, costs: PrefixCosts | None, fits=lambda agent, r: True) -> list[str]:
    """Where `count` readers of the prefix held on a0 go, each fetch (after the first to a replica)
    on its way where a reader went before."""
    placement, has_prefix, chosen = Placement(), {"a0"}, []
    for i in range(count):
        agent = _reader(i)
        best = placement.choose(agent, ["a0", "a1"], set(has_prefix), True, fits, costs,
                                predicted_tokens(agent, lambda name: 0))
        has_prefix.add(best)
        chosen.append(best)
    return chosen


def test_readers_spill_to_the_idle_replica_once_the_holders_queue_outweighs_a_move():
    fast = _place(8, _costs(100e6))  # a move: 0.1 s, against 0.2 s of each reader's own work
    assert fast[:3] == ["a0", "a1", "a0"]  # the second reader would wait 0.2 s on a0, 0.1 s for a move
    assert fast.count("a1") == 4
    slow = _place(8, _costs(1e6))  # a move: 10 s, so the other replica computes it (1 s)
    assert slow[:6] == ["a0"] * 6 and slow[6] == "a1"  # spills once 1.2 s of work waits on a0


def test_without_a_profile_the_least_loaded_replica_wins_with_a_bonus_for_the_holder():
    assert _place(4, None) == ["a0", "a0", "a1", "a1"]  # a1 once a0 has 1.5 agents more; then it has the prefix
    costs = _costs(100e6)
    assert _place(3, costs, fits=lambda agent, r: r == "a0") == ["a0"] * 3  # no room elsewhere: ten times its work


def test_a_named_replica_wins_and_an_ended_agent_leaves_the_backlog():
    placement, costs = Placement(), _costs(100e6)
    named = _reader(0, replica="a1")
    tokens = predicted_tokens(named, lambda name: 0)
    assert placement.choose(named, ["a0", "a1"], {"a0"}, True, lambda a, r: True, costs, tokens) == "a1"
    assert placement.backlog_s["a1"] == pytest.approx(0.2 + 0.1, rel=1e-3)  # its own work and the prefix's move
    placement.finished(named)
    assert placement.backlog_s["a1"] == 0.0 and not placement.charged
    again = _reader(1)
    placement.choose(again, ["a0", "a1"], {"a0"}, True, lambda a, r: True, costs, tokens)
    placement.choose(again, ["a0", "a1"], {"a0"}, True, lambda a, r: True, costs, tokens)  # restarted: placed again
    assert sum(placement.backlog_s.values()) == pytest.approx(0.2)  # charged once


def test_an_upstream_answer_counts_at_its_max_tokens():
    agent = AgentState("b", "m", "text", [(1, 2, 3), AgentInput("a"), (4, 5)], [], 7)
    assert predicted_tokens(agent, {"a": 16}.get) == (3, 18, 7)


def test_the_simulated_clock_tallies_moves_with_their_predicted_and_measured_seconds(monkeypatch):
    import aaflow.planning.simulate as simulate_module
    from costmodel.hardware import HardwareProfile
    from costmodel.model_profile import ModelProfile
    from costmodel.workflow_spec import AgentTask, ClusterSpec, WorkflowSpec

    tallies = []

    class Recording(simulate_module.Scheduler):
        def dispose(self):
            tallies.append(self.prefix_decisions())
            super().dispose()

    monkeypatch.setattr(simulate_module, "Scheduler", Recording)
    model = ModelProfile("m", layers=30, kv_heads=3, head_dim=64, num_heads=9, params=135_000_000)
    compute = ComputeProfile(0.005, 1e-4, 1e-8, 0.02, 1e-4, 1e-7)
    spec = WorkflowSpec("fan", tuple(AgentTask(f"g{i}", "m", "doc", 2000, (400,), 8) for i in range(6)))
    hardware = HardwareProfile("box", False, "hand-built", 2e10, {"m": compute}, {"ray": LinkProfile(5e9)})
    simulate_module.simulate(spec, ClusterSpec((("s0", "m"), ("s1", "m"))), hardware, {"m": model},
                             {a.name: "transfer" for a in spec.agents})
    tally = tallies[0]
    assert tally["first"]["count"] == 1 and tally["first"]["tokens"] == 2000
    move = tally["move:ray"]
    assert move["count"] == move["chosen"] == 1 and move["bytes"] > 0  # simulated agents are planned: the cost model chose
    assert 0 < move["predicted_s"] <= move["measured_s"]  # the simulated call adds its overhead
