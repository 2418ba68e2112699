"""The serving table `aaflow report` writes (aaflow/benchmarks/serve_report.py): verdicts by shape."""

from __future__ import annotations

import json

from aaflow.benchmarks.report import rewrite
from aaflow.benchmarks.serve_report import BEGIN, END, table, verdict

BURST = {"workflows": 64, "documents": 8, "repeats": 3}
PRESSURED = {"workflows": 64, "documents": 64, "repeats": 3}


def _row(ratio, p50=0.9, p99=0.9) -> dict:
    return {"throughput_ratio": ratio, "latency_p50_s_ratio": p50, "latency_p99_s_ratio": p99}


def test_verdicts_follow_the_targets_of_each_shape():
    assert verdict("burst", BURST, _row(1.35)) == "met"
    assert verdict("burst", BURST, _row(1.25)) == "missed (throughput < 1.3x)"
    assert verdict("burst", BURST, _row(1.3, p99=1.05)) == "missed (p99 above vLLM's)"
    assert verdict("burst", PRESSURED, _row(1.3)) == "missed (throughput < 1.5x)"
    assert verdict("burst", PRESSURED, _row(1.6, p50=1.2)) == "met"  # latency is not its target
    skewed = {**BURST, "hot_documents": 2}
    assert verdict("skewed (2 hot) burst", skewed, _row(1.4)) == "missed (throughput < 1.5x)"
    assert verdict("skewed (2 hot) burst", skewed, _row(1.55)) == "met"
    assert verdict("poisson-2/s", BURST, _row(0.8, p99=0.95)) == "met"
    assert verdict("poisson-2/s", BURST, _row(1.5, p99=1.01)) == "missed (p99)"
    assert verdict("burst", BURST, {}) == "n/a (no vLLM side)"
    assert verdict("burst", {**BURST, "repeats": 1}, _row(1.6)).startswith("indicative")
    assert verdict("burst", BURST, {"http_throughput_ratio": 0.9}) == "HTTP 0.90x af.submit: met"
    assert verdict("burst", BURST, {"http_throughput_ratio": 0.8}) == "HTTP 0.80x af.submit: missed (< 0.85x)"
    two = {**BURST, "replicas": 2}
    assert verdict("burst", two, _row(1.35)) == "met"  # every router policy tried (the default)
    assert verdict("burst", {**two, "router_policies": ["consistent_hash"]}, _row(1.37)) == (
        "indicative (router policies tried: consistent_hash of 4)")


def test_the_table_is_written_between_its_markers(tmp_path):
    report = {"machine": {"cpu_kind": "amd-avx2"}, "settings": {**BURST, "doc_tokens": 700, "dtype": "auto"},
              "shapes": {"burst": {"aaflow": {"workflows_per_min": 60.0, "latency_p50_s": 30.0, "latency_p99_s": 60.0,
                                              "prompt_computed": 100},
                                   "vllm": {"workflows_per_min": 40.0, "latency_p50_s": 35.0, "latency_p99_s": 70.0,
                                            "prompt_computed": 200},
                                   "vllm_mode": "vllm-graph-b32", **_row(1.5)}}}
    (tmp_path / "serve_x.json").write_text(json.dumps({**report, "vllm_engines": {"vllm-graph-b32": {"block_size": 32}}}))
    (tmp_path / "serve_untuned.json").write_text(json.dumps(report))  # vLLM at its default block size only
    md = tmp_path / "RESULTS.md"
    md.write_text(f"intro\n{BEGIN}\nold\n{END}\nrest\n")
    rewrite(md, table(tmp_path), BEGIN, END)
    text = md.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "| serve_x.json burst | amd-avx2 |" in text and "1.50x" in text and "100 / 200" in text and "| met |" in text
    assert "(vllm-graph-b32)" in text and "serve_untuned.json" not in text


def test_a_graph_aware_vllm_client_gets_its_own_row_and_target(tmp_path):
    side = {"workflows_per_min": 8.0, "latency_p50_s": 360.0, "latency_p99_s": 470.0, "prompt_computed": 134000}
    row = {"aaflow": side, "graph_aware_best": "vllm-graph-b32+capped", "graph_aware_throughput_ratio": 1.07,
           "vllm_graph_aware": {"vllm-graph-b32+capped": {**side, "workflows_per_min": 7.5}}}
    assert verdict("burst", PRESSURED, row, graph_aware=True) == "missed (throughput < 1.2x)"
    assert verdict("burst", PRESSURED, {**row, "graph_aware_throughput_ratio": 1.25}, graph_aware=True) == "met"
    report = {"machine": {"cpu_kind": "amd-avx2"}, "settings": {**PRESSURED, "doc_tokens": 2000, "dtype": "auto"},
              "vllm_engines": {"vllm-graph-b32": {"block_size": 32}}, "shapes": {"burst": row}}
    (tmp_path / "serve_mem.json").write_text(json.dumps(report))
    text = table(tmp_path)
    assert "(vllm-graph-b32+capped) | 1.07x |" in text and "missed (throughput < 1.2x)" in text
    assert text.count("| serve_mem.json burst |") == 1  # the plain client was not repeated: no row of its own
