"""`aaflow bench endpoint`: a 1 -> 6 fan-out as 7 chat requests with workflow hints, against `af.run`.

A SmolLM2 cluster of `--replicas` replicas (`af.init`, dtype auto) and its OpenAI-compatible
endpoint on loopback (uvicorn in this process). The fan-out of `aaflow bench workflows` (an
analyzer over a `--doc-tokens` document, six generators reading it and the analysis) runs, in
turn: through `af.run` under `auto`; as 7 streaming chat requests with `agent_hints` (the analyzer
first, the six once it answered: `aaflow.benchmarks.http_load`); and as the same requests without hints.
Prefix caches are cleared before each timed run; one untimed run of each first. Reports wall
seconds (medians of `--repeats`), the HTTP / af.run ratio, and the prompt tokens the replicas
computed in each run (the counter the replicas keep), against the document's length.
"""

from __future__ import annotations

import argparse
import statistics
import time

from aaflow.benchmarks.common import add_dtype_argument, engine_tokens_computed, log, machine_facts, wait_until_quiet, write_json

SIDES = ("af.run", "http-hints", "http-plain")


def run(args) -> dict:
    import ray

    import aaflow as af
    from aaflow.serving import BackgroundServer, serving_app
    from aaflow.benchmarks.http_load import run_http
    from aaflow.benchmarks.ray_head import free_ports
    from aaflow.benchmarks.scaling_bench import context_text
    from aaflow.benchmarks.workflow_shapes import fan_out_workflow

    cluster = af.init(replicas={"smollm2": args.replicas}, dtype=args.dtype)
    server = BackgroundServer(serving_app(cluster), port=free_ports(1)[0])

    def once(side: str, tag: str) -> dict:
        wf = fan_out_workflow(context_text(args.doc_tokens, 71), 6, args.max_tokens)
        wf.name = f"fan-out-{tag}"
        ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])
        wait_until_quiet()
        before, began = engine_tokens_computed(cluster), time.perf_counter()
        if side == "af.run":
            af.run(wf, cluster, strategy="auto")
            wall = time.perf_counter() - began  # as its client sees it, as the HTTP side's
        else:
            out = run_http(f"{server.url}/v1", "smollm2", [wf], [0.0], ignore_eos=True, hints=side == "http-hints")
            if "error" in out["rows"][0]:
                raise RuntimeError(f"{side}: {out['rows'][0]['error']}")
            wall = out["wall_s"]
        return {"wall_s": wall, "prompt_computed": engine_tokens_computed(cluster) - before}

    samples: dict[str, list] = {side: [] for side in SIDES}
    try:
        for side in SIDES:
            once(side, f"warm-{side}")
        for rep in range(args.repeats):
            for side in SIDES[rep % 3:] + SIDES[:rep % 3]:
                s = once(side, f"{rep}-{side}")
                samples[side].append(s)
                log(f"rep {rep + 1} {side}: {s['wall_s']:.2f} s, {s['prompt_computed']} prompt tokens computed")
    finally:
        server.stop()
        cluster.shutdown()
    medians = {side: {k: statistics.median(s[k] for s in v) for k in v[0]} | {"samples": v}
               for side, v in samples.items()}
    report = {"benchmark": "endpoint", "machine": machine_facts(), "settings": {k: v for k, v in vars(args).items()
                                                                                if k not in ("func", "out")},
              "sides": medians, "http_over_af_run": medians["http-hints"]["wall_s"] / medians["af.run"]["wall_s"]}
    log(f"with hints, HTTP / af.run wall: {report['http_over_af_run']:.3f}; prompt tokens computed: "
        + ", ".join(f"{side} {m['prompt_computed']:.0f}" for side, m in medians.items())
        + f" (document ~{args.doc_tokens})")
    write_json(args.out, report)
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--doc-tokens", type=int, default=2800)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    add_dtype_argument(p)
    p.add_argument("--out", default="results/endpoint.json")
