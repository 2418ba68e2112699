"""One block of one side of `aaflow bench regression`, run by path with PYTHONPATH at that side's
checkout: it uses only what every revision has (`af.init`, `af.load_workflow`, `af.run`, a
replica's `clear_prefix_cache` and `stats`), so an older revision runs it unchanged.

    python regression_side.py SPEC.json OUT.json

SPEC: {"workflow": YAML path, "model": name, "replicas": n, "dtype": ..., "chunk_tokens": n,
"strategies": [...], "repeats": n, "checkout": the side's folder}. OUT: the code that ran and one
row per timed run, in run order."""

from __future__ import annotations

import hashlib
import json
import sys
import time

import ray

import aaflow as af


def _idle_wait() -> None:
    """Let the previous run's threads settle before the next timed run (the side's helper when it has one)."""
    try:
        from benchmarks.common import wait_until_quiet
    except ImportError:
        time.sleep(1.0)
    else:
        wait_until_quiet()


def _tokens_digest(result) -> str:
    """One hash of every agent's token ids: equal digests, equal outputs."""
    ids = {name: list(agent.token_ids) for name, agent in sorted(result.agents.items())}
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    if not af.__file__.startswith(spec["checkout"]):
        raise SystemExit(f"regression_side: imported aaflow from {af.__file__}, not from {spec['checkout']}")
    wf = af.load_workflow(spec["workflow"])
    cluster = af.init(replicas={spec["model"]: spec["replicas"]}, dtype=spec["dtype"])
    try:
        worker = ray.get(ray.remote(num_cpus=0)(lambda: __import__("aaflow").__file__).remote())
        if not worker.startswith(spec["checkout"]):
            raise SystemExit(f"regression_side: Ray workers import aaflow from {worker}, not {spec['checkout']}")

        def cold_run(strategy: str):
            replicas = cluster.replicas()
            ray.get([r.actor.clear_prefix_cache.remote() for r in replicas])
            before = sum(s["tokens_computed"] for s in ray.get([r.actor.stats.remote() for r in replicas]))
            res = af.run(wf, cluster, strategy=strategy, chunk_tokens=spec["chunk_tokens"])
            after = sum(s["tokens_computed"] for s in ray.get([r.actor.stats.remote() for r in replicas]))
            return res, after - before

        strategies = spec["strategies"]
        for s in strategies:  # untimed: kernels, sessions, the planner's profile and plan memo
            cold_run(s)
        rows = []
        for r in range(spec["repeats"]):
            for s in strategies[r % len(strategies):] + strategies[:r % len(strategies)]:
                _idle_wait()
                res, engine_tokens = cold_run(s)
                rows.append({"strategy": s, "wall_s": res.total_s, "planning_s": res.planning_s,
                             "engine_tokens_computed": engine_tokens,
                             "plan": sorted({a.strategy for a in res.agents.values()}),
                             "tokens_digest": _tokens_digest(res)})
                print(f"[regression] {spec['side']} {s}: {res.total_s:.2f} s", file=sys.stderr, flush=True)
    finally:
        cluster.shutdown()
    with open(out_path, "w") as f:
        json.dump({"aaflow": af.__file__, "rows": rows}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
