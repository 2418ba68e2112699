"""The tally of how replicas got the shared prefixes they lacked (aaflow/runtime/prefix_decisions.py),
on the simulated clock: each kind counted, with the cost model's predicted seconds beside the
measured ones."""

from __future__ import annotations

from aaflow.costmodel.hardware import ComputeProfile, LinkProfile


def test_the_simulated_clock_tallies_moves_with_their_predicted_and_measured_seconds(monkeypatch):
    import aaflow.planner.simulate as simulate_module
    from aaflow.costmodel.hardware import HardwareProfile
    from aaflow.costmodel.model_profile import ModelProfile
    from aaflow.costmodel.workflow_spec import AgentTask, ClusterSpec, WorkflowSpec

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
