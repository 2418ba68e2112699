"""Benchmarks are timing jobs, not tests: here only that each module imports, its parser builds, and
the shared plotting helper writes a PNG. Nothing is run or timed."""

from __future__ import annotations

import argparse
import importlib

import pytest

from aaflow.cli import BENCHMARKS, build_parser

QUICK = ["scaling", "overhead", "consistency", "workflows", "load", "chaos", "overlap-bound", "loop-scale"]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_module_imports_and_parser_builds(name):
    module = importlib.import_module(BENCHMARKS[name])
    assert callable(module.run)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--quick"] if name in QUICK else ["--against", "HEAD"] if name == "regression" else [])
    if name in QUICK:
        assert args.quick and args.out == f"results/{name}.json"


@pytest.mark.parametrize("name", QUICK)
def test_new_benchmarks_are_registered_with_quick(name):
    assert name in BENCHMARKS
    args = build_parser().parse_args(["bench", name, "--quick"])
    assert args.quick and args.name == name


def test_bench_all_accepts_quick():
    args = build_parser().parse_args(["bench", "all", "--quick"])
    assert args.name == "all" and args.quick


def test_plots_write_png(tmp_path):
    from aaflow.benchmarks.plots import write_plot

    out = write_plot(tmp_path / "tiny.json", [
        {"title": "lines", "xlabel": "agents", "series": {"text": {1: 10, 4: 40}, "auto": {1: 10, 4: 12}},
         "logx": True, "hlines": {"paper": 20}},
        {"title": "bars", "series": {"text": {"chain": 3.0, "fan-out": None}, "auto": {"chain": 2.0}}},
    ])
    assert out == tmp_path / "tiny.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _speed(tok_per_s):
    return {"tok_per_s": tok_per_s}


REPORTS = {  # the smallest report of each shape the benchmark writes
    "engine_bench": {"dtype": "bfloat16", "threads": {"aaflow": 1},
                     "aaflow": {"prefill": {"512": _speed(900.0)}, "decode": {"1024x1": _speed(20.0)}},
                     "aaflow_deterministic": {"prefill": {"512": _speed(850.0)}, "decode": {"1024x1": _speed(18.0)}},
                     "transformers": {"prefill": {"512": _speed(700.0)}, "decode": {"1024x1": _speed(13.0)}},
                     "vllm": {"skipped": "--vllm none"}},
    "memory_bench": {"fork": {"pool_bytes": 2**27}, "independent_copies": {"pool_bytes": 2**30},
                     "memory_reduction_x": 8.0},
    "transfer_bench": {"memcpy_bytes_per_s": 6e9, "rows": [
        {"tokens": n, "recompute_ttft_s": n / 1e3,
         "transports": {"ray": {"ttft_s": 0.1 + n / 4e4, "fetch_bytes_per_s": 3e9}}} for n in (512, 4096)]},
    "serve_bench": {"machine": {"cpu_kind": "amd-avx2"}, "shapes": {
        "burst": {"aaflow": {"workflows_per_min": 60.0, "latency_p50_s": 30.0, "latency_p99_s": 60.0},
                  "vllm": {"workflows_per_min": 50.0, "latency_p50_s": 35.0, "latency_p99_s": 70.0}},
        "poisson-1/s": {"aaflow": {"workflows_per_min": 55.0, "latency_p50_s": 3.0, "latency_p99_s": 6.0}}}},
    "compose_bench": {"summary": {"rerotate": {"top1_next_token_mean": 0.93, "top1_agreement_mean": 0.9,
                                               "compose_s_median": 0.004, "full_prefill_s_median": 0.1}}},
}


@pytest.mark.parametrize("module", sorted(REPORTS))
def test_each_benchmark_draws_its_report(tmp_path, module):
    importlib.import_module(f"aaflow.benchmarks.{module}")._plot(str(tmp_path / "r.json"), REPORTS[module])
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_baseline_engines_see_the_workflow_as_text_passing():
    from aaflow.benchmarks.baseline_engines import agent_specs
    from aaflow.benchmarks.workflow_shapes import map_reduce_workflow

    agents = agent_specs({"mr": map_reduce_workflow("A short document.", 4)})["mr"]
    order = [a["name"] for a in agents]  # dependency order: transformers runs them in it
    assert order[-1] == "meta" and sorted(order[:-1]) == ["r_limitations", "r_method", "r_novelty"]
    meta = agents[-1]
    assert meta["prompt"][0] == "A short document." and {"ref": "r_novelty"} in meta["prompt"]


def test_baseline_engines_prompt_the_text_aaflows_agents_run(smollm2_dir):
    """vLLM and transformers get each agent's parts inside the chat template, as aaflow's agents do:
    the same text for an agent whose parts are all text (a bare join would be another prompt). aaflow
    tokenizes each part apart (a context's KV is reused as is), so a join may split differently."""
    from transformers import AutoTokenizer

    from aaflow.runtime.prompts import PromptBuilder
    from aaflow.benchmarks.baseline_engines import agent_specs, chat_prompt
    from aaflow.benchmarks.workflow_shapes import map_reduce_workflow

    wf = map_reduce_workflow("A short document about rivers.", 4)
    wf.agent("solo", "smollm2", ["Say hello."], system="You are brief.")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    builder = PromptBuilder(tokenizer)
    for spec in agent_specs({"mr": wf})["mr"]:
        if any(isinstance(p, dict) for p in spec["prompt"]):
            continue  # reads another agent: its text is known only at run time
        aaflow_ids = [t for seg in builder.segments(wf, wf.nodes[spec["name"]]) for t in seg]
        baseline_text = chat_prompt(tokenizer, spec, {})
        assert tokenizer.decode(aaflow_ids) == baseline_text, spec["name"]
        assert abs(len(tokenizer(baseline_text).input_ids) - len(aaflow_ids)) <= len(spec["prompt"]), spec["name"]


def test_planner_choice_is_judged_by_autos_own_runs():
    from aaflow.benchmarks.planner_bench import judge_choice

    samples = {"text": [5.5, 5.5], "recompute": [4.2, 4.4], "transfer": [4.8, 4.8], "auto": [5.0, 5.2]}
    # even when auto's plan is recompute for every agent, recompute's runs do not stand in for auto's
    judged = judge_choice(samples, {"A": "recompute", "B": "recompute"})
    assert judged["choice_s"] == pytest.approx(5.1)
    assert not judged["choice_within_10pct_of_best"]  # 5.1 > 1.1 * 4.3
    assert judged["choice_not_worse_than_text"]  # 5.1 <= 5.5
    assert not judge_choice({**samples, "auto": [5.6, 5.8]}, {"A": "text"})["choice_not_worse_than_text"]


def test_report_table_verdicts_from_a_workflows_json(tmp_path):
    """`aaflow report`: met only when auto <= 0.9x vLLM and <= text; misses say against what; the
    paper's figures judged against their targets."""
    import json

    from aaflow.benchmarks.report import BEGIN, END, rewrite, summary

    report = {"machine": {"cpu_kind": "test"}, "settings": {"repeats": 3, "dtype": "bfloat16", "replicas": 2},
              "workflows": {"chain": {"text": {"wall_s": 10.0}, "auto": {"wall_s": 8.0}, "text-nocache": {"wall_s": 12.0}},
                            "fan_out": {"text": {"wall_s": 5.0}, "auto": {"wall_s": 6.0}},
                            "a_b_x1": {"text": {"wall_s": 2.0},
                                       "auto": {"wall_s": 1.9, "response_speedup_vs_text": 1.31}},
                            "map_reduce": {"text": {"wall_s": 2.0},
                                           "auto": {"wall_s": 1.5, "latency_reduction_vs_text": 0.25}}},
              "vllm": {"chain": {"wall_s": 9.0, "mode": "eager"}, "fan_out": {"wall_s": 9.0, "mode": "graph"}},
              "deployments": {"1": {"chain": {"text": {"wall_s": 7.0}, "auto": {"wall_s": 6.5}}}}}
    (tmp_path / "workflows.json").write_text(json.dumps(report))
    table = summary(tmp_path)
    chain = next(line for line in table.splitlines() if line.startswith("| chain | reported"))
    fan = next(line for line in table.splitlines() if line.startswith("| fan_out | reported"))
    assert "1.12x | met | - |" in chain and "12.00 s" in chain and "9.00 s (eager)" in chain
    assert fan.endswith("1.50x | missed (vs text) | - |")
    assert "response 1.31x (target 1.3x): met |" in table and "25% lower latency (target 40%): missed |" in table
    assert "| chain | 7.00 s | 6.50 s | 10.00 s | 8.00 s |" in table  # 1 replica, then 2
    md = tmp_path / "RESULTS.md"
    md.write_text(f"intro\n{BEGIN}\nold\n{END}\nrest\n")
    rewrite(md, table)
    assert md.read_text().startswith(f"intro\n{BEGIN}\nRun:") and md.read_text().endswith(f"{END}\nrest\n")


@pytest.mark.parametrize("n", [2, 4, 6])
def test_workflows_repeat_order_is_balanced(n):
    from aaflow.benchmarks.workflows_bench import repeat_order

    sides = [f"s{i}" for i in range(n)]
    orders = [repeat_order(sides, r) for r in range(n)]
    assert all(sorted(o) == sorted(sides) for o in orders)
    assert sorted(o[0] for o in orders) == sorted(sides)  # each side first once
    pairs = [(o[i], o[i + 1]) for o in orders for i in range(n - 1)]
    assert len(set(pairs)) == len(pairs) == n * (n - 1)  # each side right after each other side once
    assert repeat_order(sides, n) == orders[0]


def test_regression_sides_take_turns_and_name_what_is_over_the_tolerance():
    from aaflow.benchmarks.regression_ab import resolve_revision, run_order, summarize

    assert [run_order(r) for r in range(3)] == [("old", "new"), ("new", "old"), ("old", "new")]
    run = {"engine_tokens_computed": 10, "plan": ["text"], "tokens_digest": "d"}
    samples = {"old": {"text": [{**run, "wall_s": w} for w in (10.0, 11.0, 12.0)]},
               "new": {"text": [{**run, "wall_s": w} for w in (12.0, 13.0, 90.0)]}}
    row = summarize(samples, ["text"], 0.05)["text"]
    assert row["ratio"] == pytest.approx(13 / 11) and not row["within_tolerance"] and row["same_tokens"]
    assert row["paired_ratio_median"] == pytest.approx(12 / 10)  # of 12/10, 13/11, 90/12
    samples["new"]["text"] = [{**run, "wall_s": 11.0}, {**run, "wall_s": 11.4, "tokens_digest": "other"},
                              {**run, "wall_s": 90.0}]
    row = summarize(samples, ["text"], 0.05)["text"]
    assert row["within_tolerance"] and not row["same_tokens"]
    with pytest.raises(SystemExit, match="not a commit"):
        resolve_revision("no-such-revision-anywhere")


def test_prompt_tokens_computed_come_from_the_replicas_counters():
    """A shared prefix materialized by its own call counts as computed (the requests' usage calls it
    reused); decode rows (each agent's tokens but the first) are taken out."""
    from aaflow.benchmarks.serve_load import prompt_computed_by_replicas
    from aaflow.benchmarks.serve_shapes import documents, serve_workflows

    workflows = serve_workflows(2, documents(1, 50), 4)  # 2 x 3 agents, 4 tokens each
    summary = {"completed": 2, "generated_tokens": 24, "prompt_computed": 30, "restarts": 0}
    prompt_computed_by_replicas(summary, 500, workflows)
    assert (summary["prompt_computed"], summary["prompt_computed_by_requests"]) == (500 - (24 - 6), 30)
    kept = {"completed": 2, "generated_tokens": 24, "prompt_computed": 30, "restarts": 1}
    prompt_computed_by_replicas(kept, 500, workflows)  # a restart's decode rows are unknown
    assert kept["prompt_computed"] == 30 and "prompt_computed_by_requests" not in kept
