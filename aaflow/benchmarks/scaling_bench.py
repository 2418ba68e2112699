"""`aaflow bench scaling`: N agents sharing one long context (AAFLOW+ exp2), `text` vs aaflow strategies.

Workflow: one context of `--context` tokens (the shipped paper repeated, cut to that many tokens)
and N agents, each asking its own short question about it (`--max-tokens`, ignore_eos), on a
2-replica SmolLM2 cluster. Per N and strategy (medians of `--repeats`, strategies alternated
inside each repeat, prefix caches cleared before every run):
  * compute: prompt tokens the agents prefilled (`res.metrics["prefill_computed"]`, which leaves out
    a context materialized once for sharing), tokens the engines ran through a forward pass
    (replica `stats()["tokens_computed"]` before/after: shared contexts and decode steps included;
    the compute ratio uses this one), and CPU-seconds of the two replica processes (user + system time read from /proc/<pid>/stat
    before and after the run; the replicas are local Ray actors, so this is their real CPU use,
    decode included);
  * latency: `res.wall_s`; throughput: workflows per minute = 60 / wall_s (one workflow at a time).
Ratios text / strategy for compute and strategy / text for throughput (`text`: prefix cache on),
and the same against `text-nocache` (`*_vs_nocache_x`: AAFLOW+'s baseline, text passing with no
KV reuse), next to AAFLOW+'s modeled figures at 16 agents (7.63x less compute, 7.74x throughput).
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import lru_cache

from aaflow.benchmarks.common import (add_dtype_argument, engine_tokens_computed, kv_bytes_per_token, log, machine_facts,
                               run_options, write_json)
from aaflow.configs import CONFIG_DIR

PAPER = {"compute_x": 7.63, "throughput_x": 7.74, "agents": 16, "source": "AAFLOW+ (cost model)"}


@lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    from aaflow.models import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path("smollm2", quiet=True)))


def context_text(tokens: int, offset: int = 0) -> str:
    """About `tokens` SmolLM2 tokens of the shipped paper, repeated as needed (`offset` rotates the start)."""
    tok = _tokenizer()
    ids = tok.encode((CONFIG_DIR / "workflows" / "paper.txt").read_text(), add_special_tokens=False)
    reps = (tokens + offset) // len(ids) + 2
    return tok.decode((ids * reps)[offset: offset + tokens])


def token_count(text: str) -> int:
    return len(_tokenizer().encode(text, add_special_tokens=False))


def replica_cpu_s(cluster) -> float:
    """User + system CPU-seconds so far of every replica process (local actors, read from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for info in cluster.info.values():
        with open(f"/proc/{info['pid']}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
    return total


def cold_run(cluster, wf, strategy: str, chunk_tokens: int = 16):
    """Clear every replica's prefix cache, run once; returns (RunResult, replica CPU-seconds,
    tokens the engines computed: prefill of agents and of materialized contexts, plus decode steps)."""
    import ray

    import aaflow as af

    ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])
    cpu0, tok0 = replica_cpu_s(cluster), engine_tokens_computed(cluster)
    res = af.run(wf, cluster, chunk_tokens=chunk_tokens, **run_options(strategy))
    return res, replica_cpu_s(cluster) - cpu0, engine_tokens_computed(cluster) - tok0


def _workflow(n: int, context: str, max_tokens: int):
    import aaflow as af

    wf = af.Workflow(f"scaling-{n}")
    ctx = wf.context("shared", context)
    for i in range(n):
        wf.agent(f"q{i}", "smollm2", [ctx, f"Question {i}: in one sentence, what does section {i + 1} claim?"],
                 max_tokens=max_tokens, ignore_eos=True)
    return wf


def run(args) -> dict:
    import aaflow as af

    if args.quick:
        args.agents = args.agents or [1, 4, 16]
        args.context = args.context or 2048
        args.repeats = args.repeats or 1
    args.strategies = ["text"] + [s for s in args.strategies if s != "text"]  # the baseline, first
    agents, context, repeats = args.agents or [1, 2, 4, 8, 16], args.context or 4096, args.repeats or 3
    text = context_text(context)
    per_agent = context + 64 + args.max_tokens
    pool = int(max(agents) * per_agent * 1.25) * kv_bytes_per_token(args.dtype)
    cluster = af.init(replicas={"smollm2": 2}, dtype=args.dtype, kv_cache_bytes=pool)
    report = {"benchmark": "scaling", "machine": machine_facts(), "paper": PAPER,
              "settings": {**{k: v for k, v in vars(args).items() if k not in ("func", "out")},
                           "agents": agents, "context": context, "repeats": repeats,
                           "context_tokens_measured": token_count(text)},
              "cpu_seconds_method": "utime+stime of the replica processes from /proc/<pid>/stat around each run",
              "rows": {}}
    try:
        if not args.no_warmup:  # loads kernels and the planner's profile once
            for s in args.strategies:
                cold_run(cluster, _workflow(1, text, args.max_tokens), s, args.chunk_tokens)
        for n in agents:
            wf = _workflow(n, text, args.max_tokens)
            samples = {s: [] for s in args.strategies}
            for _ in range(repeats):
                for s in args.strategies:
                    res, cpu, engine_tok = cold_run(cluster, wf, s, args.chunk_tokens)
                    samples[s].append({"prefill_computed": res.metrics["prefill_computed"],
                                       "engine_tokens_computed": engine_tok,
                                       "prefill_reused": res.metrics["prefill_reused"], "cpu_s": cpu,
                                       "wall_s": res.wall_s, "workflows_per_min": 60.0 / res.wall_s,
                                       "planning_s": res.planning_s,
                                       "bytes_moved": res.metrics["bytes_moved"]})
            row = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in samples.items()}
            for s in args.strategies:
                if s == "text":
                    continue
                row[s]["compute_reduction_x"] = row["text"]["prefill_computed"] / max(1, row[s]["prefill_computed"])
                row[s]["engine_compute_reduction_x"] = (row["text"]["engine_tokens_computed"]
                                                        / max(1, row[s]["engine_tokens_computed"]))
                row[s]["cpu_reduction_x"] = row["text"]["cpu_s"] / max(1e-9, row[s]["cpu_s"])
                row[s]["throughput_x"] = row[s]["workflows_per_min"] / row["text"]["workflows_per_min"]
                if "text-nocache" in row:  # AAFLOW+ exp2's baseline: text passing with no KV reuse
                    nocache = row["text-nocache"]
                    row[s]["engine_compute_reduction_vs_nocache_x"] = (nocache["engine_tokens_computed"]
                                                                       / max(1, row[s]["engine_tokens_computed"]))
                    row[s]["throughput_vs_nocache_x"] = row[s]["workflows_per_min"] / nocache["workflows_per_min"]
            report["rows"][str(n)] = row
            log(f"{n:>2} agents: " + "; ".join(
                f"{s} {row[s]['prefill_computed']:.0f}/{row[s]['engine_tokens_computed']:.0f} tok {row[s]['cpu_s']:.1f} cpu-s {row[s]['wall_s']:.1f} s"
                + (f" ({row[s]['engine_compute_reduction_x']:.2f}x compute, {row[s]['throughput_x']:.2f}x thr)"
                   if s != "text" else "") for s in args.strategies))
    finally:
        cluster.shutdown()
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def _plot(out, report) -> None:
    from aaflow.benchmarks.plots import write_plot

    rows, strategies = report["rows"], report["settings"]["strategies"]

    def series(key):
        return {s: {int(n): r[s].get(key) for n, r in rows.items()} for s in strategies}

    ratios = {f"{s} compute": {int(n): r[s]["engine_compute_reduction_x"] for n, r in rows.items()}
              for s in strategies if s != "text"}
    ratios.update({f"{s} throughput": {int(n): r[s]["throughput_x"] for n, r in rows.items()}
                   for s in strategies if s != "text"})
    write_plot(out, [
        {"title": "tokens computed by the engines", "xlabel": "agents", "ylabel": "tokens",
         "series": series("engine_tokens_computed"),
         "logx": True, "logy": True},
        {"title": "replica CPU-seconds", "xlabel": "agents", "ylabel": "s", "series": series("cpu_s"), "logx": True},
        {"title": "throughput", "xlabel": "agents", "ylabel": "workflows / min", "series": series("workflows_per_min"),
         "logx": True},
        {"title": "vs text", "xlabel": "agents", "ylabel": "x", "series": ratios, "logx": True,
         "hlines": {"AAFLOW+ 7.63x compute": PAPER["compute_x"]}},
    ], suptitle=f"{report['settings']['context']}-token shared context, 2 SmolLM2 replicas")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="1, 4, 16 agents, 2,048-token context, 1 repeat")
    p.add_argument("--agents", type=int, nargs="+", default=None, help="default 1 2 4 8 16")
    p.add_argument("--context", type=int, default=None, help="shared context tokens (default 4096)")
    p.add_argument("--strategies", nargs="+", default=["text", "text-nocache", "auto", "transfer+stream"],
                   help="add /no-lend to a name (auto/no-lend) to run it without lending idle cores")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each agent generates (ignore_eos)")
    add_dtype_argument(p)
    p.add_argument("--chunk-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", default="results/scaling.json")
