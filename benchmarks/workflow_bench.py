"""`aaflow bench workflow`: workflows on a two-replica SmolLM2 cluster, `text` vs aaflow strategies.

* A->B microbenchmark (FlashAgents' setup scaled to SmolLM2): B's prompt is a long system prompt
  plus A's output; `concurrency` independent pairs run at once. Metric: downstream response
  latency = B's first token - A's first token; also B's handoff gap (B's first token - A's last).
* map-reduce: three reviewers and a meta-reviewer over the shipped paper (repeated to ~2,000
  tokens), end-to-end latency.
* `--downstream-model M`: the heterogeneous pair (FlashAgents' stream-across-models case): A on
  SmolLM2, B on model M, one replica each; only tokens cross the edge. Map-reduce is skipped.
Every measurement starts with cold prefix caches; strategies alternate inside each repeat.
"""

from __future__ import annotations

import argparse
import statistics

from aaflow.demo import review_workflow
from benchmarks.common import add_dtype_argument, kv_bytes_per_token, log, machine_facts, write_json
from configs import CONFIG_DIR


def _pair_workflow(concurrency: int, system_prompt: str, a_tokens: int, b_model: str = "smollm2"):
    import aaflow as af

    wf = af.Workflow(f"a-b-x{concurrency}")
    guide = wf.context("guide", system_prompt)
    for i in range(concurrency):
        a = wf.agent(f"A{i}", "smollm2", [f"Write a short paragraph about topic number {i}: the ocean."],
                     max_tokens=a_tokens, ignore_eos=True)
        wf.agent(f"B{i}", b_model, [guide, "Draft to improve:", a, "Rewrite it in one sentence."], max_tokens=16,
                 ignore_eos=True)
    return wf


def _cold_run(cluster, wf, strategy, chunk_tokens):
    import ray

    import aaflow as af

    ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])
    return af.run(wf, cluster, strategy=strategy, chunk_tokens=chunk_tokens)


def run(args) -> dict:
    args.quick = getattr(args, "quick", False)
    if args.quick:
        args.concurrency, args.repeats = [1, 8], 1
    import aaflow as af

    system_prompt = "\n\n".join([(CONFIG_DIR / "workflows" / "paper.txt").read_text()] * args.system_repeats)
    hetero = args.downstream_model != "smollm2"
    replicas = {"smollm2": 1, args.downstream_model: 1} if hetero else {"smollm2": 2}
    # a replica holds up to every pair's B prompt at once (text passing computes each in full); sized in bf16
    kv_bytes = 256 * 2**20 * max(1, -(-max(args.concurrency) // 8)) * kv_bytes_per_token(args.dtype) // kv_bytes_per_token("bfloat16")
    cluster = af.init(replicas=replicas, dtype=args.dtype, kv_cache_bytes=kv_bytes)
    report = {"benchmark": "workflow", "machine": machine_facts(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")}, "pairs": {}}
    try:
        for c in args.concurrency:
            wf = _pair_workflow(c, system_prompt, args.a_tokens, args.downstream_model)
            samples = {s: [] for s in args.strategies}
            if not (args.quick and c != args.concurrency[0]):  # warm-up, not recorded (quick: once)
                for s in args.strategies:
                    _cold_run(cluster, wf, s, args.chunk_tokens)
            for _ in range(args.repeats):
                for s in args.strategies:
                    res = _cold_run(cluster, wf, s, args.chunk_tokens)
                    lat = [res[f"B{i}"].first_token_s - res[f"A{i}"].first_token_s for i in range(c)]
                    gaps = [res[f"B{i}"].handoff_gap_s for i in range(c)]
                    samples[s].append({"response_latency_s": statistics.mean(lat), "handoff_gap_s": statistics.mean(gaps),
                                       "wall_s": res.wall_s, "planning_s": res.planning_s,
                                       "prefill_computed": res.metrics["prefill_computed"]})
            row = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in samples.items()}
            for s in args.strategies[1:]:
                row[s]["speedup_vs_text"] = row["text"]["response_latency_s"] / row[s]["response_latency_s"]
            report["pairs"][str(c)] = row
            log(f"A->B x{c}: " + ", ".join(f"{s} {row[s]['response_latency_s']:.2f} s" for s in args.strategies)
                + " | " + ", ".join(f"{s} {row[s]['speedup_vs_text']:.2f}x" for s in args.strategies[1:]))
        if not hetero:
            report["map_reduce"] = _map_reduce(cluster, args)
    finally:
        cluster.shutdown()
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def _map_reduce(cluster, args) -> dict:
    wf = review_workflow(args.doc_tokens, ignore_eos=True)
    samples = {s: [] for s in ("text", "auto")}
    planning = []
    for _ in range(args.repeats):
        for s in samples:
            res = _cold_run(cluster, wf, s, args.chunk_tokens)
            samples[s].append(res.wall_s)
            if s == "auto":
                planning.append(res.planning_s)
    mr = {s: statistics.median(v) for s, v in samples.items()}
    mr["latency_reduction"] = 1 - mr["auto"] / mr["text"]
    mr["auto_planning_s"] = statistics.median(planning)  # before the run, not in its wall time
    log(f"map-reduce: text {mr['text']:.2f} s, auto {mr['auto']:.2f} s, {mr['latency_reduction']:.0%} lower")
    return mr


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_dtype_argument(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--strategies", nargs="+", default=["text", "stream", "auto"])
    p.add_argument("--a-tokens", type=int, default=64, help="tokens the upstream agent A generates")
    p.add_argument("--system-repeats", type=int, default=3, help="copies of the paper in B's system prompt")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--chunk-tokens", type=int, default=16)
    p.add_argument("--downstream-model", default="smollm2",
                   help="B's model (e.g. llama-360m-random, random weights: timing only); another model "
                        "runs the heterogeneous pair on one replica per model and skips map-reduce")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/workflow.json")
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 8, one repeat, one warm-up round")


def _plot(out, report) -> None:
    from benchmarks.plots import write_plot

    pairs = report["pairs"]
    strategies = list(next(iter(pairs.values()))) if pairs else []
    panels = [{"title": "A->B: B's response latency", "xlabel": "pairs", "ylabel": "s",
               "series": {s: {int(c): row[s]["response_latency_s"] for c, row in pairs.items()} for s in strategies}}]
    if "map_reduce" in report:
        mr = report["map_reduce"]
        panels.append({"title": f"map-reduce: {mr['latency_reduction']:.0%} lower", "kind": "bar", "ylabel": "s",
                       "series": {"end-to-end": {"text": mr["text"], "auto": mr["auto"]}}})
    write_plot(out, panels)
