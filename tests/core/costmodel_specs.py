"""Hand-built inputs shared by the simulator and planner tests (test_costmodel_simulator.py,
test_costmodel_planner.py): a SmolLM2-sized model profile, a CPU-like compute profile, and builders
of hardware profiles, clusters, agents and uniform strategy assignments."""

from __future__ import annotations

from aaflow.costmodel.hardware import ComputeProfile, HardwareProfile, LinkProfile
from aaflow.costmodel.model_profile import ModelProfile
from aaflow.costmodel.workflow_spec import AgentTask, ClusterSpec, WorkflowSpec

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
