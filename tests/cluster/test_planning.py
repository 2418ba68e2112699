"""The planner on real workflows: calibration on a live cluster, `af.plan`, auto following the plan,
projections onto shipped GPU profiles, and `aaflow plan` / `aaflow calibrate` errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

import aaflow as af
from aaflow.cluster.calibration import calibrate
from aaflow.costmodel.hardware import HardwareProfile
from aaflow.costmodel.profile_store import model_key
from tests.frontend.test_workflow_run import DOC, map_reduce


@pytest.fixture(scope="module")
def calibrated(tiny_llama_dir, tmp_path_factory):
    cluster = af.init(replicas={str(tiny_llama_dir): 2}, num_cpus=2, dtype="float32", kv_cache_bytes=8 * 2**20)
    out = tmp_path_factory.mktemp("hw") / "tiny.yaml"
    profile = calibrate(cluster, name="tiny-test", out=out, transports=("ray",), progress=None)
    yield cluster, str(tiny_llama_dir), profile, out
    cluster.shutdown()


def test_calibration_measures_compute_links_and_saves_a_profile(calibrated):
    import ray

    cluster, _, profile, out = calibrated
    key = model_key(ray.get(cluster.replicas()[0].actor.info.remote()))
    assert profile.measured and key in profile.compute and "ray" in profile.links
    compute = profile.compute[key]
    assert compute.prefill_time(256) > compute.prefill_time(16) > 0  # more tokens never cost less
    assert compute.decode_step_time(8) >= compute.decode_step_time(1) > 0
    assert profile.links["ray"].bandwidth_bytes_per_s > 1e6 and profile.call_overhead_s > 0
    assert profile.concurrency_slowdown >= 1.0
    assert compute.prefill_s_per_member >= 0.0  # fitted from packed prefills
    assert HardwareProfile.load(out) == profile


def test_links_measured_again_keep_the_compute_entries_and_replace_the_link(calibrated):
    from dataclasses import replace

    from aaflow.cluster.calibration import calibrate_links
    from aaflow.costmodel.hardware import LinkProfile

    cluster, _, profile, _ = calibrated
    stale = replace(profile, links={"ray": LinkProfile(1.0, 9.0)})  # as if calibrated over another network
    again = calibrate_links(cluster, stale, ("ray",), tokens=(16, 128), progress=None)
    assert again.compute == profile.compute and again.memcpy_bytes_per_s == profile.memcpy_bytes_per_s
    assert again.links["ray"].bandwidth_bytes_per_s > 1e6 and again.links["ray"].latency_s < 9.0
    assert "links ray measured again" in again.source


def test_a_quick_fit_off_by_too_much_is_measured_again_on_the_full_grid(calibrated, monkeypatch):
    import aaflow.cluster.calibration as calibration

    cluster, *_ = calibrated
    monkeypatch.setattr(calibration, "QUICK_FIT_MAX_ERROR", -1.0)  # any quick fit is off by too much
    said: list[str] = []
    profile = calibrate(cluster, name="tiny-test", transports=(), progress=said.append)
    assert any("on the quick grid; measuring the full grid" in line for line in said), said
    assert "(full grid)" in profile.source and "(quick grid)" not in profile.source, profile.source


def test_plan_covers_every_agent_and_run_follows_it(calibrated):
    cluster, model, profile, _ = calibrated
    wf = map_reduce(model)
    plan = af.plan(wf, cluster, hardware=profile)
    assert set(plan.decisions) == {"r0", "r1", "r2", "meta"} and not plan.projection
    assert plan.predicted.makespan_s <= plan.baseline.makespan_s  # never predicted worse than text
    text = plan.explain()
    assert all(name in text for name in plan.decisions) and "PROJECTION" not in text
    baseline = af.run(wf, cluster, strategy="text")
    res = af.run(wf, cluster, strategy="auto", plan=plan)
    assert {n: a.strategy for n, a in res.agents.items()} == plan.decisions
    assert all(res[n].token_ids == baseline[n].token_ids for n in plan.decisions)
    json.dumps(plan.to_dict())


def test_projection_onto_a_shipped_gpu_profile_is_labelled(calibrated):
    _, model, _, _ = calibrated
    plan = af.plan(map_reduce(model), {model: 2}, hardware="a100-80gb", link="25Gbps")
    assert plan.projection and plan.hardware_name == "a100-80gb"
    assert "PROJECTION (not measured here)" in plan.explain()


def test_plan_refuses_unknown_hardware_and_bad_links(calibrated):
    _, model, profile, _ = calibrated
    with pytest.raises(af.CostModelError, match="no-such-gpu"):
        af.plan(map_reduce(model), {model: 2}, hardware="no-such-gpu")
    with pytest.raises(af.CostModelError, match="fast-ish"):
        af.plan(map_reduce(model), {model: 2}, hardware=profile, link="fast-ish")


def test_plan_without_a_cluster_uses_the_named_dtype(calibrated):
    cluster, model, profile, _ = calibrated
    wf = map_reduce(model)
    plans = {d: af.plan(wf, {model: 2}, hardware="a100-80gb", link="25Gbps", dtype=d) for d in ("float32", "bfloat16")}
    assert plans["float32"].baseline.peak_kv_bytes == 2 * plans["bfloat16"].baseline.peak_kv_bytes
    with pytest.raises(af.CostModelError, match="run float32, not bfloat16"):  # the live replicas' dtype rules
        af.plan(wf, cluster, hardware=profile, dtype="bfloat16")


def test_plan_without_a_profile_says_to_calibrate(calibrated, monkeypatch, tmp_path):
    _, model, _, _ = calibrated
    monkeypatch.setattr("aaflow.costmodel.profile_store.default_profile_name", lambda: "never-calibrated-host")
    monkeypatch.setenv("AAFLOW_CACHE_DIR", str(tmp_path))
    with pytest.raises(af.CostModelError, match="aaflow calibrate"):
        af.plan(map_reduce(model), {model: 2})


def test_the_profile_read_on_every_auto_run_is_reread_once_its_file_changes(calibrated, monkeypatch, tmp_path):
    """find_profile memoizes the parsed YAML by the file's modification time and size: an unchanged
    file comes back as the same object, a recalibrated one is read again."""
    from dataclasses import replace

    from aaflow.costmodel.profile_store import cached_profile_path, find_profile

    _, _, profile, _ = calibrated
    monkeypatch.setattr("aaflow.costmodel.profile_store.default_profile_name", lambda: "memo-test-host")
    monkeypatch.setenv("AAFLOW_CACHE_DIR", str(tmp_path))
    path = cached_profile_path("memo-test-host")
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    first = find_profile()
    assert first == profile and find_profile() is first
    recalibrated = replace(profile, call_overhead_s=profile.call_overhead_s * 3 + 0.0123)
    recalibrated.save(path)
    assert find_profile() == recalibrated != first


def test_cli_plan_projects_a_yaml_workflow(calibrated, tmp_path):
    _, model, _, _ = calibrated
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump({
        "name": "pair", "contexts": {"doc": DOC},
        "agents": {"a": {"model": model, "prompt": [{"ref": "doc"}, "Go."], "max_tokens": 4},
                   "b": {"model": model, "prompt": [{"ref": "doc"}, {"ref": "a"}, "Next."], "max_tokens": 4}}}))
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "aaflow.cli", "plan", str(path), "--hardware", "h100",
                           "--link", "100Gbps", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "PROJECTION" in proc.stdout and set(json.loads(out.read_text())["decisions"]) == {"a", "b"}


def test_a_workflow_planned_again_reuses_its_plan_and_a_changed_one_is_planned_anew(calibrated):
    """The search is deterministic in its inputs, so the same workflow on the same cluster and
    profile gets its earlier plan back (af.run on "auto" pays the search once per workflow); any
    change to the prompts' token counts, the cluster or the profile plans again."""
    _, model, _, _ = calibrated

    def reviews(doc: str):
        wf = af.Workflow("reviews")
        paper = wf.context("paper", doc)
        revs = [wf.agent(f"r{i}", model, [paper, f"Review aspect {i}."], max_tokens=10) for i in range(3)]
        wf.agent("meta", model, [paper, *revs, "Meta-review."], max_tokens=10)
        return wf

    first = af.plan(reviews(DOC), {model: 2}, hardware="a100-80gb", link="25Gbps")
    assert af.plan(reviews(DOC), {model: 2}, hardware="a100-80gb", link="25Gbps") is first
    assert af.plan(reviews(DOC), {model: 3}, hardware="a100-80gb", link="25Gbps") is not first
    assert af.plan(reviews(DOC), {model: 2}, hardware="a100-80gb", link="100Gbps") is not first
    assert af.plan(reviews(DOC + " One more sentence."), {model: 2}, hardware="a100-80gb", link="25Gbps") is not first
