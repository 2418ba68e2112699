"""`aaflow.benchmarks.vllm_fleet`: N real `vllm serve` instances behind a real `vllm-router` (.venv-vllm).

Skips unless `bash scripts/setup_vllm_env.sh` has made .venv-vllm with vllm-router. Two eager
instances with 32-token blocks, one core each, 1 GiB of KV each; a small load of the serving
shape through the router from the same `openai` client `bench serve --replicas` uses, under two
policies; vLLM's own counters read from the instances' /metrics.
"""

from __future__ import annotations

import pytest

from aaflow.benchmarks.vllm_subprocess import VLLM_PYTHON


@pytest.fixture(scope="module")
def fleet():
    if not (VLLM_PYTHON.parent / "vllm-router").exists():
        pytest.skip("vLLM or vllm-router is not installed: run `bash scripts/setup_vllm_env.sh`")
    from aaflow.models import resolve_model_path
    from aaflow.benchmarks.vllm_config import VllmConfig
    from aaflow.benchmarks.vllm_fleet import VllmFleet, split_cores

    with VllmFleet(str(resolve_model_path("smollm2", quiet=True)), VllmConfig("eager", 32), split_cores(2, 2),
                   1 << 30, "float32", policy="round_robin") as fleet:
        yield fleet


def test_a_load_through_the_router_under_two_policies(fleet):
    from aaflow.benchmarks.serve_replicas import fleet_load
    from aaflow.benchmarks.serve_shapes import documents, serve_workflows

    workflows = serve_workflows(4, documents(2, 150), 4)
    for policy in ("round_robin", "cache_aware"):
        load = fleet_load(fleet, policy, workflows, [0.0] * 4, ignore_eos=True)
        assert fleet.policy == policy
        assert load["completed"] == 4 and not load["failed"]
        assert load["generated_tokens"] == 4 * 3 * 4
        assert load["prompt_computed"] > 0 and load["prompt_reused"] > 0  # b and c read a's document
        # vLLM's own counters over the load: every prompt looked up once, hits whole 32-token blocks
        assert load["prefix_cache_queries"] >= load["prompt_computed"] + load["prompt_reused"]
        assert load["prefix_cache_hits"] == load["prompt_reused"] and load["prefix_cache_hits"] % 32 == 0
        assert load["preemptions"] == 0


def test_a_policy_the_router_does_not_have_is_refused(fleet):
    with pytest.raises(ValueError, match="use one of"):
        fleet.set_policy("fastest")


def test_a_missing_router_is_named_with_the_command_that_installs_it(tmp_path, monkeypatch):
    """Runs without vLLM: the fleet checks for vllm-router before it starts any instance."""
    import aaflow.benchmarks.vllm_fleet as vllm_fleet
    from aaflow.benchmarks.vllm_config import VllmConfig
    from aaflow.benchmarks.vllm_subprocess import VllmError

    monkeypatch.setattr(vllm_fleet, "VLLM_PYTHON", tmp_path / "bin" / "python")  # a venv without vllm-router
    with pytest.raises(VllmError, match=r"vllm-router not found: run `bash scripts/setup_vllm_env.sh`"):
        vllm_fleet.VllmFleet("model", VllmConfig("graph", 32), [[0], [1]], 1 << 30, "float32")
