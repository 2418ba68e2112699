"""`aaflow run --replicas auto`: the planner picks how the cores are split into replicas for a
workflow, each split predicted from the profile's entry for its thread count."""

from __future__ import annotations

from pathlib import Path

import pytest

from aaflow.common.errors import CostModelError
from aaflow.cluster.planning.split import candidate_splits, choose_split
from aaflow.costmodel.hardware import ComputeProfile, HardwareProfile, LinkProfile
from tests.frontend.test_workflow_run import chain, map_reduce

ONE_THREAD = ComputeProfile(prefill_fixed_s=0.004, prefill_s_per_token=2e-4, prefill_s_per_token_ctx=1e-8,
                            decode_fixed_s=0.02, decode_s_per_seq=1e-3, decode_s_per_seq_ctx=1e-7)


def _profile(model: str, two_thread_speedup: float | None) -> HardwareProfile:
    name = Path(model).name
    compute = {f"{name}|float32|1t": ONE_THREAD}
    if two_thread_speedup is not None:
        compute[f"{name}|float32|2t"] = ONE_THREAD.scaled(1 / two_thread_speedup)
    return HardwareProfile("split-test", True, "test", memcpy_bytes_per_s=1e10, compute=compute,
                           links={"ray": LinkProfile(1e9, 1e-4)}, call_overhead_s=1e-3)


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)


def test_candidates_split_the_cores_evenly():
    assert candidate_splits(1, 2) == [1, 2]
    assert candidate_splits(1, 6) == [1, 2, 3, 6]
    assert candidate_splits(2, 4) == [1, 2]
    assert candidate_splits(3, 2) == [1]


def test_a_chain_takes_one_replica_on_every_core_when_two_threads_compute_faster(tiny_llama_dir, two_cores):
    model = str(tiny_llama_dir)
    choice = choose_split(chain(model), dtype="float32", hardware=_profile(model, 1.9))
    assert choice.replicas == 1 and choice.predicted_s[1] < choice.predicted_s[2]
    assert "<- chosen" in choice.explain()


def test_parallel_agents_take_two_replicas_when_two_threads_gain_nothing(tiny_llama_dir, two_cores):
    model = str(tiny_llama_dir)
    choice = choose_split(map_reduce(model), dtype="float32", hardware=_profile(model, 1.0))
    assert choice.replicas == 2 and choice.predicted_s[2] < choice.predicted_s[1]


def test_a_split_the_profile_never_measured_names_the_fix(tiny_llama_dir, two_cores):
    model = str(tiny_llama_dir)
    with pytest.raises(CostModelError, match="aaflow calibrate --replicas 1"):
        choose_split(chain(model), dtype="float32", hardware=_profile(model, None))
