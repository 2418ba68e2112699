"""One side of `aaflow bench regression`, run by path with PYTHONPATH at that side's checkout: it
uses only what every revision has (`af.init`, `af.load_workflow`, `af.run`, a replica's
`clear_prefix_cache` and `stats`), so an older revision runs it unchanged.

    python regression_side.py SPEC.json

SPEC: {"side": name, "checkout": the side's folder, "workflow": YAML path, "model", "replicas",
"dtype", "chunk_tokens", "strategies"}. It starts its cluster, runs each strategy once untimed,
then answers on stdout one line `@regression {json}` per line read on stdin: "ready" first, then
for a strategy name a cold run's row (prefix caches cleared first); "quit" ends it. Anything else
the side prints goes to stderr."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys

import ray

import aaflow as af

PREFIX = "@regression "


def _tokens_digest(result) -> str:
    """One hash of every agent's token ids: equal digests, equal outputs."""
    ids = {name: list(agent.token_ids) for name, agent in sorted(result.agents.items())}
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _cold_run(cluster, wf, strategy: str, chunk_tokens: int) -> dict:
    replicas = cluster.replicas()
    ray.get([r.actor.clear_prefix_cache.remote() for r in replicas])
    before = sum(s["tokens_computed"] for s in ray.get([r.actor.stats.remote() for r in replicas]))
    res = af.run(wf, cluster, strategy=strategy, chunk_tokens=chunk_tokens)
    after = sum(s["tokens_computed"] for s in ray.get([r.actor.stats.remote() for r in replicas]))
    return {"strategy": strategy, "wall_s": res.total_s, "planning_s": res.planning_s,
            "engine_tokens_computed": after - before, "plan": sorted({a.strategy for a in res.agents.values()}),
            "tokens_digest": _tokens_digest(res)}


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    answer = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        if not af.__file__.startswith(spec["checkout"]):
            raise SystemExit(f"regression_side: imported aaflow from {af.__file__}, not from {spec['checkout']}")
        wf = af.load_workflow(spec["workflow"])
        cluster = af.init(replicas={spec["model"]: spec["replicas"]}, dtype=spec["dtype"])
        try:
            worker = ray.get(ray.remote(num_cpus=0)(lambda: __import__("aaflow").__file__).remote())
            if not worker.startswith(spec["checkout"]):
                raise SystemExit(f"regression_side: Ray workers import aaflow from {worker}, not {spec['checkout']}")
            for s in spec["strategies"]:  # untimed: kernels, sessions, the planner's profile and plan memo
                _cold_run(cluster, wf, s, spec["chunk_tokens"])
            print(PREFIX + json.dumps({"ready": af.__file__}), file=answer, flush=True)
            for line in sys.stdin:
                command = line.strip()
                if command == "quit":
                    break
                row = _cold_run(cluster, wf, command, spec["chunk_tokens"])
                print(PREFIX + json.dumps(row), file=answer, flush=True)
        finally:
            cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
