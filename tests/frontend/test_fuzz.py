"""Fuzzing (Hypothesis) on a small budget: every surface's failures are typed `AAFlowError`s, no case
hangs, and pools hold nothing a case did not keep. `aaflow bench fuzz` runs >= 1,000 cases per surface.

Strict: the first untyped error, hang or invariant violation fails the test with Hypothesis's
shrunk (smallest) failing case.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="pip install 'hypothesis>=6.100,<7' (the test extra)")

from aaflow.benchmarks.fuzz import SURFACE_NAMES, make_models, make_surface, run_surface  # noqa: E402

EXAMPLES = {"workflow_graphs": 60, "yaml_files": 40, "operator_arguments": 60, "kv_payloads": 80}


@pytest.fixture(scope="module")
def fuzz_models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("fuzz-models"))


@pytest.mark.parametrize("surface", SURFACE_NAMES)
def test_every_failure_is_typed_and_bounded(fuzz_models, surface):
    with make_surface(surface, *fuzz_models) as s:
        report = run_surface(s, EXAMPLES[surface], seed=2026, strict=True)
    assert report.cases >= EXAMPLES[surface] // 2, f"{surface}: only {report.cases} cases ran"
    assert report.failed == 0, report.as_dict()
    assert report.ok + sum(report.typed.values()) == report.cases


def test_fuzzed_workflows_run_on_a_cluster(fuzz_models):
    """Random small workflows under random strategies and transports: each completes with every
    agent's tokens or is refused typed, and leaves no block, ref or session on the replicas."""
    with make_surface("workflow_runs", *fuzz_models) as s:
        report = run_surface(s, 15, seed=2026, strict=True)
    assert report.failed == 0 and sum(v for k, v in report.steps.items() if k.startswith("ran ")) >= 5, report.as_dict()


def test_the_fuzzer_reports_an_untyped_error(fuzz_models, monkeypatch):
    """The harness itself: an operator that fails untyped is caught, counted and shrunk."""
    import importlib

    def broken(n):
        raise KeyError("not a typed error")

    monkeypatch.setattr(importlib.import_module("aaflow.operators.fork"), "check_fork_count", broken)
    with make_surface("operator_arguments", *fuzz_models) as s:
        report = run_surface(s, 60, seed=1)
    assert report.untyped > 0 and "KeyError" in report.failures[0]["error"]
