"""`aaflow bench load`: many workflows submitted at once from several driver threads to one cluster.

`--workflows` small workflows (3 agents: an analyst reads a ~500-token context, two writers read the
context and its output; each its own document) are run with `af.run` from `--threads` threads
against one cluster of two SmolLM2 replicas, all submitted at once. A monitor samples every
replica's used KV blocks while they run. Reported: how many completed, failed or returned other
tokens than the same workflow run alone (the engines run `deterministic`, so batching cannot change
a token), per-workflow latency p50 / p99 (submission to result), throughput, peak KV blocks used
against the pool, and the preemptions the runs' events record.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, write_json
from aaflow.benchmarks.scaling_bench import context_text


def small_workflow(i: int, context_tokens: int, max_tokens: int):
    import aaflow as af

    wf = af.Workflow(f"load-{i}")
    doc = wf.context("doc", context_text(context_tokens, 29 * i))
    analyst = wf.agent("analyst", "smollm2", [doc, "List the two main claims."], max_tokens=max_tokens,
                       ignore_eos=True)
    for name in ("summary", "critique"):
        wf.agent(name, "smollm2", [doc, "Claims:", analyst, f"Write a one-sentence {name}."],
                 max_tokens=max_tokens, ignore_eos=True)
    return wf


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _monitor(cluster, stop: threading.Event, peak: dict) -> None:
    import ray

    while not stop.is_set():
        for r in cluster.replicas():
            used = ray.get(r.actor.stats.remote())["used_blocks"]
            peak[r.name] = max(peak.get(r.name, 0), used)
        stop.wait(0.2)


def run(args) -> dict:
    import aaflow as af

    if args.quick:
        args.workflows, args.threads = 16, 4
    workflows = [small_workflow(i, args.context_tokens, args.max_tokens) for i in range(args.workflows)]
    pool = {"kv_cache_bytes": args.kv_cache_bytes} if args.kv_cache_bytes else {}
    cluster = af.init(replicas={"smollm2": args.replicas}, dtype=args.dtype, deterministic=True, **pool)
    report = {"benchmark": "load", "machine": machine_facts(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")}}
    try:
        pools = {name: info["kv_blocks"] for name, info in cluster.info.items()}
        log(f"{args.workflows} workflows alone first (the reference tokens) ...")
        alone = [af.run(wf, cluster, strategy=args.strategy) for wf in workflows]
        peak, stop = {}, threading.Event()
        watcher = threading.Thread(target=_monitor, args=(cluster, stop, peak), daemon=True)
        watcher.start()

        def submit(i: int):
            t0 = time.perf_counter()
            try:
                return af.run(workflows[i], cluster, strategy=args.strategy), time.perf_counter() - t0, None
            except Exception as exc:  # noqa: BLE001 - counted and reported
                return None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"

        log(f"... then all {args.workflows} at once from {args.threads} threads")
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.threads) as pool:
            outcomes = list(pool.map(submit, range(args.workflows)))
        wall = time.perf_counter() - start
        stop.set()
        watcher.join()
        import ray

        # every run has ended: what the pools still hold is leaked (or pinned) KV
        end_used = {r.name: ray.get(r.actor.stats.remote())["used_blocks"] for r in cluster.replicas()}
    finally:
        cluster.shutdown()
    done = [(i, res, s) for i, (res, s, err) in enumerate(outcomes) if res is not None]
    latencies = [s for _, _, s in done]
    differ = [i for i, res, _ in done
              if any(res[n].token_ids != alone[i][n].token_ids for n in res.agents)]
    report.update({
        "completed": len(done), "failed": [err for _, _, err in outcomes if err], "differ_from_alone": differ,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p99_s": _percentile(latencies, 0.99) if latencies else None,
        "wall_s": wall, "workflows_per_min": 60 * len(done) / wall,
        "alone_wall_s_median": statistics.median(r.wall_s for r in alone),
        "peak_used_blocks": peak, "end_used_blocks": end_used, "pool_blocks": pools,
        "over_budget": any(peak.get(n, 0) > pools[n] for n in pools),
        "preemptions": sum(e.count("preempted") for _, res, _ in done for e in res.events),
    })
    log(f"load: {len(done)}/{args.workflows} completed, {len(report['failed'])} failed, {len(differ)} differ; "
        f"p50 {report['latency_p50_s']:.2f} s, p99 {report['latency_p99_s']:.2f} s, "
        f"{report['workflows_per_min']:.1f} workflows/min; peak KV {peak} of {pools}, held at the end {end_used}")
    write_json(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="16 workflows from 4 threads")
    p.add_argument("--workflows", type=int, default=64)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--context-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--kv-cache-bytes", default=None, metavar="SIZE",
                   help="KV pool per replica, e.g. 96MiB: small enough that admission must queue and preempt "
                        "(default: the machine's share)")
    add_dtype_argument(p)
    p.add_argument("--out", default="results/load.json")
