"""`aaflow bench soak`: 1,000 operator cycles and 100 workflow runs on a tiny model; leaks show up as
resources that do not come back to their baseline.

A 2-replica cluster of a tiny random-weight model (fp32). One operator cycle: materialize, fork,
transfer (rotating over every transport that runs here), exact compose, generate, evict, free all.
One workflow run: a fan-out or a chain under a rotating strategy. Before (after one warm-up cycle and
run, so lazily made buffers and registrations exist), between and after: each replica's used pool
blocks, KV refs and sessions, the object store's bytes and objects, open file descriptors and RSS of
the driver and of each replica. Blocks, refs, sessions and objects must return to the baseline
exactly; file descriptors too; RSS within `--rss-bound-mib` per process (allocator caches grow).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from aaflow.benchmarks.common import log, machine_facts, write_json

STRATEGIES = ["text", "recompute", "transfer", "stream", "auto"]


def object_store_usage() -> dict:
    """Plasma MiB and objects held now, as `ray memory --stats-only` reports them."""
    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    match = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    return {"mib": int(match.group(1)), "objects": int(match.group(2))} if match else {"unparsed": text[-200:]}


def _process(pid: int) -> dict:
    import psutil

    proc = psutil.Process(pid)
    return {"rss_mib": round(proc.memory_info().rss / 2**20, 1), "open_fds": proc.num_fds(),
            "threads": proc.num_threads()}


def snapshot(cluster) -> dict:
    """Resources held now: per replica, the driver, the object store."""
    import ray

    replicas = {}
    for r in cluster.replicas():
        stats, sessions = ray.get([r.actor.stats.remote(), r.actor.session_count.remote()])
        replicas[r.name] = {"used_blocks": stats["used_blocks"], "refs": stats["refs"], "sessions": sessions,
                            **_process(cluster.info[r.name]["pid"])}
    return {"replicas": replicas, "driver": _process(os.getpid()), "object_store": object_store_usage()}


def operator_cycle(cluster, model: str, i: int, transport: str) -> None:
    import aaflow as af

    a, b = cluster.replicas(model)
    context = [20 + (i * 7 + j) % 250 for j in range(40 + i % 60)]
    kv = af.materialize(cluster, model, context, replica=a)
    f1, f2 = af.fork(kv, 2)
    moved = af.transfer(f1, b, transport=transport)
    both = af.compose(kv, f2)  # f2 continues kv's context: exact
    out = af.generate(moved, [5, 6, 7], 4, ignore_eos=True)
    assert len(out.token_ids) == 4
    af.evict(both)
    for ref in (kv, f1, f2, moved, both):
        af.free(ref)


def workflow(model: str, i: int):
    import aaflow as af

    wf = af.Workflow(f"soak-{i}")
    doc = wf.context("doc", "Shared context for the soak: keys and values. " * (2 + i % 4))
    root = wf.agent("root", model, [doc, f"Analyze {i}."], max_tokens=6)
    for k in range(1 + i % 3):
        wf.agent(f"leaf{k}", model, [doc, root, f"Variant {k}."], max_tokens=4)
    return wf


def _flat(snap: dict) -> dict:
    """Totals over the processes of a snapshot: blocks, refs, sessions, fds, RSS, store objects."""
    procs = list(snap["replicas"].values()) + [snap["driver"]]
    totals = {k: round(sum(p.get(k, 0) for p in procs), 1) for k in ("used_blocks", "refs", "sessions",
                                                                       "open_fds", "rss_mib")}
    return {**totals, "store_objects": snap["object_store"].get("objects")}


def _deltas(before: dict, after: dict, rss_bound_mib: float) -> dict:
    out, ok = {}, True
    for name, b in before["replicas"].items():
        a = after["replicas"][name]
        d = {k: round(a[k] - b[k], 1) for k in b}
        ok &= d["used_blocks"] == d["refs"] == d["sessions"] == d["open_fds"] == 0 and d["rss_mib"] <= rss_bound_mib
        out[name] = d
    out["driver"] = {k: round(after["driver"][k] - before["driver"][k], 1) for k in before["driver"]}
    ok &= out["driver"]["open_fds"] == 0 and out["driver"]["rss_mib"] <= rss_bound_mib
    store_b, store_a = before["object_store"], after["object_store"]
    out["object_store"] = {k: store_a.get(k, 0) - store_b.get(k, 0) for k in ("mib", "objects")}
    ok &= out["object_store"]["objects"] == 0
    out["back_to_baseline"] = bool(ok)
    return out


def run(args) -> dict:
    import aaflow as af
    from aaflow.models.tiny import make_tiny_model
    from aaflow.cluster.transports import available_transports

    if args.quick:
        args.cycles, args.runs = min(args.cycles, 100), min(args.runs, 10)
    transports = [t for t, ok in available_transports().items() if ok is True and t != "local"]
    folder = Path(tempfile.mkdtemp(prefix="aaflow-soak-"))
    model = str(make_tiny_model(folder / "llama", "llama", max_position_embeddings=4096))
    cluster = af.init(replicas={model: 2}, num_cpus=2, dtype="float32", kv_cache_bytes=16 * 2**20)
    try:
        for t in transports:  # warm-up: every transport's buffers and registrations exist before the baseline
            operator_cycle(cluster, model, 0, t)
        for strategy in STRATEGIES:
            af.run(workflow(model, 0), cluster, strategy=strategy)
        before = snapshot(cluster)
        checkpoints = {}  # cycles done -> snapshot: a leak grows with them, a one-time allocation does not
        start = time.perf_counter()
        for i in range(args.cycles):
            operator_cycle(cluster, model, i, transports[i % len(transports)])
            if (i + 1) % max(1, args.cycles // 5) == 0:
                checkpoints[i + 1] = _flat(snapshot(cluster))
                log(f"{i + 1} operator cycles: {checkpoints[i + 1]}")
        cycles_s = time.perf_counter() - start
        between = snapshot(cluster)
        start = time.perf_counter()
        for i in range(args.runs):
            af.run(workflow(model, i), cluster, strategy=STRATEGIES[i % len(STRATEGIES)])
        runs_s = time.perf_counter() - start
        after = snapshot(cluster)
    finally:
        cluster.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    report = {"benchmark": "soak", "machine": machine_facts(),
              "settings": {"cycles": args.cycles, "runs": args.runs, "transports": transports,
                           "rss_bound_mib": args.rss_bound_mib},
              "seconds": {"operator_cycles": round(cycles_s, 1), "workflow_runs": round(runs_s, 1)},
              "before": before, "after_cycles": between, "after_runs": after, "checkpoints": checkpoints,
              "deltas_after_cycles": _deltas(before, between, args.rss_bound_mib),
              "deltas_after_runs": _deltas(before, after, args.rss_bound_mib)}
    log(f"deltas after {args.cycles} cycles and {args.runs} runs: {report['deltas_after_runs']}")
    write_json(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cycles", type=int, default=1000, help="operator cycles")
    p.add_argument("--runs", type=int, default=100, help="workflow runs")
    p.add_argument("--rss-bound-mib", type=float, default=64.0,
                   help="largest RSS growth per process counted as back at baseline (allocator caches)")
    p.add_argument("--quick", action="store_true", help="100 cycles, 10 runs")
    p.add_argument("--out", default="results/soak.json")
