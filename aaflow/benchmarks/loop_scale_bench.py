"""`aaflow bench loop-scale`: how many replicas one scheduling loop keeps up with, on the simulated clock.

The cluster loop's scheduler (`af.plan_load`: the real `Scheduler` over `SimBackend`, call costs from
a calibrated hardware profile) runs `--workflows` of `bench serve`'s three-agent workflows (over
`--documents` documents of `--doc-tokens` tokens, all arriving at once: that many in flight) on
each of `--replicas` counts of one SmolLM2 model, for each `--hardware` profile. Per count:
* the predicted wall and the replicas' busy seconds (sum, and mean per replica);
* the loop's turns (replica calls it handed on) and its CPU seconds (`time.thread_time` over the
  loop: the scheduler deciding plus the simulated replicas' bookkeeping, so an upper bound on the
  decisions alone), per turn;
* the loop's share: its CPU seconds against the mean replica's busy seconds. One loop serves every
  replica, so the share grows with the replica count; at 100% the replicas wait on the loop.
  `share_at_real_rate` counts each turn at what a call costs the real loop on a live cluster, Ray's
  submit, wait and result included (`--real-call-ms`, else measured first: `measure_real_call_ms`),
  in place of the simulated loop's cost.
`limit_replicas` per profile: the largest count measured whose share stays under `--share-limit`,
simulated (`limit_replicas`) and at the real loop's rate (`limit_replicas_at_real_rate`).
"""

from __future__ import annotations

import argparse

from aaflow.benchmarks.common import log, machine_facts, write_json
from aaflow.benchmarks.serve_shapes import documents, serve_workflows
from aaflow.benchmarks.vllm_config import code_commit

SHARE_LIMIT = 0.05  # the loop's own time, at most this share of a replica's busy time


def run(args) -> dict:
    import aaflow as af

    if args.quick:
        args.workflows, args.documents, args.replicas = 40, 8, [2, 8]
    docs = documents(args.documents, args.doc_tokens)
    report = {"benchmark": "loop-scale", "machine": machine_facts(), "code_commit": code_commit(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")}, "profiles": {}}
    if args.real_call_ms is None:
        args.real_call_ms = measure_real_call_ms()
        log(f"the real loop: {args.real_call_ms:.2f} ms of CPU per replica call (one replica, 16 decoding runs)")
    report["real_call_ms"] = args.real_call_ms
    af.plan_load(serve_workflows(2, docs, 2), {"smollm2": 1}, hardware=args.hardware[0], progress=None)  # warm-up
    for hardware in args.hardware:
        rows = []
        for replicas in args.replicas:
            workflows = serve_workflows(args.workflows, docs, args.max_tokens)
            p = af.plan_load(workflows, {"smollm2": replicas}, strategy=args.strategy, hardware=hardware,
                             progress=None)
            busy = sum(p.busy_s.values())
            mean_busy = busy / replicas
            row = {"replicas": replicas, "wall_s": p.wall_s, "busy_s": busy, "mean_replica_busy_s": mean_busy,
                   "turns": p.turns, "loop_cpu_s": p.loop_cpu_s,
                   "loop_cpu_per_turn_ms": 1e3 * p.loop_cpu_s / max(1, p.turns),
                   "share": p.loop_cpu_s / mean_busy,
                   "share_at_real_rate": p.turns * args.real_call_ms / 1e3 / mean_busy,
                   "workflows_per_min": p.workflows_per_min}
            rows.append(row)
            log(f"{hardware}, {replicas} replicas: wall {p.wall_s:.1f} s, {p.turns} turns, loop "
                f"{p.loop_cpu_s:.2f} s CPU ({row['loop_cpu_per_turn_ms']:.2f} ms a turn), share of a replica's "
                f"busy time {100 * row['share']:.1f}% ({100 * row['share_at_real_rate']:.1f}% at the real loop's "
                f"{args.real_call_ms:g} ms a call)")
        report["profiles"][hardware] = {"rows": rows, "limit_replicas": _limit(rows, "share", args.share_limit),
                                        "limit_replicas_at_real_rate": _limit(rows, "share_at_real_rate",
                                                                              args.share_limit)}
    write_json(args.out, report)
    return report


def measure_real_call_ms(workflows: int = 16, max_tokens: int = 48) -> float:
    """The real loop's CPU per replica call on a live one-replica cluster of this machine: `workflows`
    one-agent workflows (short prompts, `max_tokens` each, from one thread each: decode steps of
    up to `workflows` rows), the loop thread's CPU seconds over the replica calls its call log counts."""
    import time

    import ray

    import aaflow as af
    from aaflow.benchmarks.serve_load import run_threads
    from aaflow.cluster.ray_backend import service_for

    def load(n: int, tokens: int) -> list:
        out = []
        for i in range(n):
            wf = af.Workflow(f"call-cost-{i}")
            wf.agent("a", "smollm2", [f"Question {i}: name one use of a cache."], max_tokens=tokens, ignore_eos=True)
            out.append(wf)
        return out

    cluster = af.init(replicas={"smollm2": 1})
    try:
        af.run(load(1, 4)[0], cluster, strategy="text")  # kernels
        loop, replica = service_for(cluster), cluster.replicas()[0]
        cpu, begin = loop.cpu_s, time.time()
        run_threads(cluster, load(workflows, max_tokens), [0.0] * workflows, "text")
        calls = [e for e in ray.get(replica.actor.call_log.remote(begin)) if e[0] != "clear_prefix_cache"]
        return 1e3 * (loop.cpu_s - cpu) / max(1, len(calls))
    finally:
        cluster.shutdown()


def _limit(rows: list[dict], key: str, limit: float) -> int | None:
    under = [r["replicas"] for r in rows if r[key] < limit]
    return max(under) if under else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="40 workflows on 2 and 8 replicas")
    p.add_argument("--replicas", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--workflows", type=int, default=1000)
    p.add_argument("--documents", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--strategy", default="text")
    p.add_argument("--hardware", nargs="+", default=["local-vm-amd-avx2"],
                   help="hardware profiles (aaflow/configs/hardware) to time calls with (a GPU profile with SmolLM2 "
                        "gives calls of microseconds, where the simulated clock runs bookkeeping calls side by "
                        "side that a replica runs in order: its busy time is then overcounted)")
    p.add_argument("--real-call-ms", type=float, default=None,
                   help="the real loop's CPU per replica call (default: measured first on a one-replica cluster)")
    p.add_argument("--share-limit", type=float, default=SHARE_LIMIT)
    p.add_argument("--out", default="results/loop-scale.json")
