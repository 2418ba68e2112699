"""`aaflow.benchmarks.vllm_config` and the fastest-configuration choice: the peer at its best, recorded.

No vLLM needed: the configurations a benchmark tries, their validation, and which one a workflow
keeps (`baseline_engines.fastest_config`). The runners that start them are tested where vLLM runs
(tests/engine/test_vllm_serve_runner.py).
"""

from __future__ import annotations

import pytest

from aaflow.benchmarks.baseline_engines import fastest_config
from aaflow.benchmarks.vllm_config import VllmConfig, code_commit, grid


def test_the_default_grid_tries_both_block_sizes_in_both_modes():
    labels = [c.label for c in grid()]
    assert labels == ["vllm-graph-b32", "vllm-graph-b128", "vllm-eager-b32", "vllm-eager-b128"]
    assert VllmConfig("eager", 64).spec() == {"enforce_eager": True, "block_size": 64, "scheduling_policy": "fcfs"}
    priority = VllmConfig("graph", 32, "priority")
    assert priority.spec() == {"enforce_eager": False, "block_size": 32, "scheduling_policy": "priority"}
    assert priority.label == "vllm-graph-b32-priority"


@pytest.mark.parametrize("mode, block, scheduling", [("eager", 16, "fcfs"), ("graph", 48, "fcfs"), ("graph", 0, "fcfs"),
                                                     ("compiled", 32, "fcfs"), ("graph", 32, "lifo")])
def test_a_configuration_vllm_cpu_cannot_run_is_refused_by_name(mode, block, scheduling):
    with pytest.raises(ValueError, match="multiples of 32|use one of"):
        VllmConfig(mode, block, scheduling)


def test_each_workflow_keeps_its_fastest_configuration_and_what_that_engine_ran():
    samples = {"vllm-graph-b32": {"chain": [4.0, 4.2, 4.1], "fan_out": [9.0, 9.4, 9.2]},
               "vllm-graph-b128": {"chain": [5.0, 5.1, 4.9], "fan_out": [8.0, 8.1, 8.2]}}
    engines = {"vllm-graph-b32": {"block_size": 32}, "vllm-graph-b128": {"block_size": 128}}
    result = fastest_config(samples, engines)
    assert result["chain"]["mode"] == "vllm-graph-b32" and result["chain"]["wall_s"] == 4.1
    assert result["chain"]["engine"] == {"block_size": 32}
    assert result["fan_out"]["mode"] == "vllm-graph-b128" and result["fan_out"]["wall_s"] == 8.1
    assert result["fan_out"]["wall_s_by_config"] == {"vllm-graph-b32": 9.2, "vllm-graph-b128": 8.1}


def test_the_code_commit_is_a_revision_of_this_checkout():
    commit = code_commit()
    assert commit == "unknown" or len(commit.split("+")[0]) >= 7
