"""The serving table of docs/RESULTS.md (`aaflow report`), from `aaflow bench serve` JSON.

One row per shape of each `docs/results/serve*.json`: the CPU kind, the load, the clients, both
sides' medians (throughput, p50 / p99 latency, prompt tokens computed) and the verdict against the
serving targets: a burst over shared documents >= 1.3x vLLM's throughput with p50 and p99 no
higher; a memory-pressured burst (as many documents as workflows) >= 1.5x, and >= 1.2x a vLLM
client that knows the graph (`--vllm-graph-clients`, its own row, e.g. `vllm-graph-b32+capped`); the
skewed burst (`--hot-documents`) >= 1.5x; Poisson arrivals
p99 <= vLLM's; the HTTP endpoint (`--http`) within 15% of `af.submit`'s throughput on the same
deployment. Runs of fewer than three repeats decide nothing. The vLLM column names the
configuration the run kept (mode and KV block size, e.g. `vllm-graph-b32`).

A run with several replicas whose vLLM side tried fewer router policies than all of them decides
nothing either ('indicative').

Only runs whose vLLM side was tuned (`vllm_engines` in the JSON: block sizes and modes tried, the
fastest kept) are in the table: a run against vLLM's default 128-token blocks compared against a
setting a performance-minded user changes (docs/RESULTS-history.md keeps those figures).
"""

from __future__ import annotations

import json
from pathlib import Path

from aaflow.benchmarks.vllm_fleet import ROUTER_POLICIES

BEGIN, END = "<!-- SERVE:BEGIN (aaflow report) -->", "<!-- SERVE:END -->"
BURST_TARGET, PRESSURED_TARGET, GRAPH_AWARE_TARGET, HTTP_TARGET, SKEWED_TARGET = 1.3, 1.5, 1.2, 0.85, 1.5
HEADER = ("| run | CPU kind | load | clients | aaflow wf/min (p50 / p99) | vLLM wf/min (p50 / p99) | "
          "throughput ratio | prompt tokens computed (aaflow / vLLM) | verdict |\n|---|---|---|---|---|---|---|---|---|")


def verdict(shape: str, settings: dict, row: dict, graph_aware: bool = False) -> str:
    """'met' or 'missed (...)' against the serving target of the shape (against the graph-aware vLLM
    client's side with `graph_aware`); a run of fewer than three repeats decides nothing ('indicative')."""
    ratio, http = row.get("throughput_ratio"), row.get("http_throughput_ratio")
    if graph_aware:
        ratio, http = row.get("graph_aware_throughput_ratio"), None
    if ratio is None and http is None:
        return "n/a (no vLLM side)"
    if settings.get("repeats", 0) < 3:
        return f"indicative ({settings.get('repeats')} repeat(s): medians of 3 decide)"
    policies = settings.get("router_policies") or ROUTER_POLICIES
    if settings.get("replicas", 1) > 1 and ratio is not None and set(policies) < set(ROUTER_POLICIES):
        return f"indicative (router policies tried: {', '.join(policies)} of {len(ROUTER_POLICIES)})"
    if ratio is None:
        return f"HTTP {http:.2f}x af.submit: " + ("met" if http >= HTTP_TARGET else f"missed (< {HTTP_TARGET}x)")
    p50, p99 = row.get("latency_p50_s_ratio"), row.get("latency_p99_s_ratio")
    if shape.startswith("poisson"):
        return "met" if p99 is not None and p99 <= 1 else "missed (p99)"
    pressured = settings.get("documents", 0) >= settings.get("workflows", 1)
    target = (GRAPH_AWARE_TARGET if graph_aware else PRESSURED_TARGET if pressured
              else SKEWED_TARGET if settings.get("hot_documents") else BURST_TARGET)
    misses = [f"throughput < {target}x"] if ratio < target else []
    if not pressured:
        misses += [f"{q} above vLLM's" for q, r in (("p50", p50), ("p99", p99)) if r is None or r > 1]
    return "met" if not misses else "missed (" + ", ".join(misses) + ")"


def _side(s: dict | None) -> str:
    if not s or "workflows_per_min" not in s:
        return "n/a"
    return f"{s['workflows_per_min']:.0f} ({s.get('latency_p50_s', 0):.1f} / {s.get('latency_p99_s', 0):.1f} s)"


def rows(path: Path) -> list[str]:
    """One table row per shape of one serve JSON."""
    report = json.loads(path.read_text())
    settings, machine = report.get("settings", {}), report.get("machine", {})
    load = (f"{settings.get('workflows')} wf over {settings.get('documents')} docs of {settings.get('doc_tokens')} "
            f"tok, KV {settings.get('kv_cache_bytes') or 'default'}, {settings.get('dtype')}")
    clients = f"{settings['processes']} processes" if settings.get("processes") else "threads"
    if settings.get("http"):
        clients += " (af.submit) and HTTP"
    if settings.get("replicas", 1) > 1:  # both sides over HTTP; vLLM's side names its router policy
        clients = f"HTTP, {settings['replicas']} replicas a side"
    out = []
    for shape, row in report.get("shapes", {}).items():
        a = row.get("aaflow")
        sides = [(row.get("vllm"), row.get("vllm_mode", "-"), row.get("throughput_ratio"), False)]
        if "graph_aware_best" in row:  # the plain client may not have been repeated (--no-vllm-plain)
            label = row["graph_aware_best"]
            sides = sides[:1] if "vllm" in row else []
            sides.append((row["vllm_graph_aware"][label], label, row["graph_aware_throughput_ratio"], True))
        for v, label, ratio, graph_aware in sides:
            computed = f"{(a or {}).get('prompt_computed', 'n/a')} / {(v or {}).get('prompt_computed', 'n/a')}"
            out.append(f"| {path.name} {shape} | {machine.get('cpu_kind', '?')} | {load} | {clients} | {_side(a)} | "
                       f"{_side(v)} ({label}) | {f'{ratio:.2f}x' if ratio else 'n/a'} | {computed} | "
                       f"{verdict(shape, settings, row, graph_aware)} |")
    return out


def peer_at_best(report: dict) -> bool:
    """Whether a run's vLLM side (if it had one) is vLLM at its best: tuned over block sizes and modes."""
    has_vllm = any("vllm" in row for row in report.get("shapes", {}).values())
    return not has_vllm or bool(report.get("vllm_engines"))


def table(results: Path) -> str:
    """The serving table from every serve*.json in the folder `results` whose peer was at its best."""
    files = sorted(f for f in results.glob("serve*.json") if peer_at_best(json.loads(f.read_text()))) \
        if results.is_dir() else []
    if not files:
        return f"(no serve*.json in {results}: run `aaflow bench serve` and copy its JSON there)"
    return "\n".join(["Medians of each run's repeats, both sides in one run; ratio > 1 means aaflow is faster.", "",
                      HEADER, *(r for f in files for r in rows(f))])
