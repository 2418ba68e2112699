"""`aaflow bench serve --replicas N`: aaflow with N replicas against N `vllm serve` behind `vllm-router`.

Both sides over HTTP from the same client (`aaflow.benchmarks.http_load.run_http`: the official `openai`
package's `AsyncOpenAI`, each agent one streaming chat request sent once its inputs answered, the
same body to both, workflow hints included; vLLM ignores them):
* aaflow: an `af.up` deployment of N SmolLM2 replicas on a loopback Ray head (the machine's cores
  split among them, each its share of the KV pool) behind `aaflow serve`;
* vLLM: N `vllm serve` instances, instance i on the cores aaflow's replica i gets and with the same
  KV bytes, behind one `vllm-router` (`aaflow.benchmarks.vllm_fleet`). At its best: a tuning pass runs every
  load once per configuration (`--vllm-modes` x `--vllm-block-sizes`) and router policy
  (`--router-policies`), and the fastest per shape is the vLLM side of the measured repeats.
Repeats alternate the sides; both sides' prefix caches are cleared before each load; medians.
"""

from __future__ import annotations

import tempfile

from aaflow.benchmarks.common import log, wait_until_quiet
from aaflow.benchmarks.serve_shapes import arrivals, shape_key, warm_up_load
from aaflow.benchmarks.serve_sides import aaflow_load, compare, medians, summarize


def run_replicas(args, report: dict, loads: dict, shapes: list) -> None:
    """Fill `report["shapes"]` with aaflow over HTTP against the tuned vLLM fleet, per shape."""
    from aaflow.engine.kv_budget import default_kv_cache_bytes, parse_bytes
    from aaflow.benchmarks.http_load import HttpEndpoint
    from aaflow.benchmarks.serve_processes import deployment

    kv_bytes = parse_bytes(args.kv_cache_bytes) if args.kv_cache_bytes else default_kv_cache_bytes(args.replicas)
    pool = {"kv_cache_bytes": kv_bytes}
    fleets, best = tune_fleet(args, loads, shapes, kv_bytes, report) if args.vllm else ({}, {})
    head, cluster = deployment(tempfile.mkdtemp(prefix="aaflow-serve-"), args.dtype, args.deterministic, pool,
                               replicas=args.replicas)
    endpoint = HttpEndpoint(head)
    try:
        aaflow_load(cluster, warm_up_load(), [0.0], args.strategy, None, endpoint.clients(True))  # kernels
        warm_links(cluster)
        for ignore_eos, workflows in loads.items():
            for shape, rate in shapes:
                key = shape_key(shape, ignore_eos)
                offsets = arrivals(len(workflows), rate, seed=1)
                sides = ["aaflow"] + ([best[key]] if key in best else [])

                def load(side: str) -> dict:
                    if side == "aaflow":
                        return aaflow_http_load(cluster, workflows, offsets, args.strategy,
                                                endpoint.clients(ignore_eos))
                    label, policy = side.split("@")
                    return fleet_load(fleets[label], policy, workflows, offsets, ignore_eos)

                samples = alternating_loads(sides, args.repeats, load, key, len(workflows))
                report["shapes"][key] = compare({side: medians(v) for side, v in samples.items()},
                                                 report.get("vllm_tuning", {}).get(key))
    finally:
        endpoint.close()
        for fleet in fleets.values():
            fleet.close()
        cluster.shutdown()
        import aaflow as af

        af.down(head.address)
        head.stop()


def alternating_loads(sides: list[str], repeats: int, load, label: str, count: int) -> dict[str, list]:
    """`load(side)` (one load of `count` workflows: its summary) `repeats` times per side, the sides
    in turn, each repeat starting one side later; logged as they end. The summaries per side."""
    samples: dict[str, list] = {}
    for rep in range(repeats):
        for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
            wait_until_quiet()
            s = load(side)
            samples.setdefault(side, []).append(s)
            moves = {k: v["count"] for k, v in s.get("prefix_decisions", {}).items()}
            log(f"{label} rep {rep + 1} {side}: {s['completed']}/{count} in {s['wall_s']:.2f} s, "
                f"p50 {s.get('latency_p50_s', 0):.2f} s, p99 {s.get('latency_p99_s', 0):.2f} s"
                + (f", prefixes {moves}" if moves else ""))
    return samples


def warm_links(cluster) -> None:
    """Move a small ref between every ordered pair of replicas over the default transport, untimed:
    a NIXL agent connects to a peer on its first fetch from it (about a second here, then ~15 ms a
    move), a one-off the measured loads should not pay, as vLLM's graphs are captured before."""
    import aaflow as af

    replicas = cluster.replicas()
    for source in replicas:
        for dest in replicas:
            if dest is not source and dest.model == source.model:
                ref = af.materialize(cluster, source.model, "A short text that warms the link.", replica=source)
                af.free(af.transfer(ref, dest))
                af.free(ref)


def aaflow_http_load(cluster, workflows: list, offsets: list[float], strategy: str, clients) -> dict:
    """One load through `aaflow serve`: `aaflow_load`'s figures plus how the deployment's replicas
    got the shared prefixes they lacked over it (moves and computations, the cost model's predicted
    seconds against the measured ones: `aaflow.runtime.prefix_decisions`)."""
    import ray

    from aaflow.runtime.prefix_decisions import difference
    from aaflow.cluster.scheduler_actor import find_scheduler

    loop = find_scheduler()
    before = ray.get(loop.prefix_decisions.remote())
    summary = aaflow_load(cluster, workflows, offsets, strategy, None, clients)
    summary["prefix_decisions"] = difference(ray.get(loop.prefix_decisions.remote()), before)
    return summary


def fleet_load(fleet, policy: str, workflows: list, offsets: list[float], ignore_eos: bool) -> dict:
    """One load through the fleet's router under `policy`, caches cleared first: `summarize`'s
    figures plus vLLM's own counters over the load."""
    from aaflow.benchmarks.http_load import run_http

    if fleet.policy != policy:
        fleet.set_policy(policy)
    fleet.reset_prefix_caches()
    before = fleet.counters()
    out = run_http(fleet.url, "smollm2", workflows, offsets, ignore_eos)
    after = fleet.counters()
    summary = summarize(out["rows"], out["wall_s"])
    summary.update({k: after[k] - before[k] for k in after})
    return summary


def tune_fleet(args, loads: dict, shapes: list, kv_bytes: int, report: dict) -> tuple[dict, dict]:
    """Every configuration x router policy runs each load once, one fleet at a time (each holds its
    KV pools); answers ({config label: fleet}, {shape key: "<config label>@<policy>"}), the fleets
    some shape keeps started again for the measured repeats. With `args.fleet_hosts`, instance i runs
    on testbed host i (`VllmFleet`'s `hosts`)."""
    from aaflow.engine.dtypes import resolve_dtype
    from aaflow.models import resolve_model_path
    from aaflow.benchmarks.vllm_config import grid
    from aaflow.benchmarks.vllm_fleet import VllmFleet, split_cores
    from aaflow.benchmarks.vllm_subprocess import VllmError

    cores, model = split_cores(args.replicas), str(resolve_model_path("smollm2", quiet=True))
    dtype = resolve_dtype(args.vllm_dtype or "auto")
    tuning: dict[str, dict[str, float]] = report.setdefault("vllm_tuning", {})
    engines, configs = report.setdefault("vllm_engines", {}), {c.label: c for c in grid(args.vllm_modes,
                                                                                           args.vllm_block_sizes)}

    def start(config):
        fleet = VllmFleet(model, config, cores, kv_bytes, dtype, args.router_policies[0],
                          hosts=getattr(args, "fleet_hosts", None))
        fleet_load(fleet, args.router_policies[0], warm_up_load(), [0.0], True)  # graphs, as aaflow warms up
        return fleet

    for config in configs.values():
        log(f"vLLM fleet {config.label}: {args.replicas} x vllm serve behind vllm-router ...")
        try:
            fleet = start(config)
        except VllmError as exc:
            report.setdefault("vllm_errors", {})[config.label] = str(exc)
            log(f"vLLM fleet {config.label} failed: {exc}")
            continue
        engines[config.label] = {"block_size": config.block_size, "enforce_eager": config.mode == "eager",
                                 "dtype": dtype, "kv_cache_bytes": kv_bytes, "instances": args.replicas,
                                 "cores": cores, "prefix_caching": True}
        for policy in args.router_policies:
            for eos, workflows in loads.items():
                for shape, rate in shapes:
                    wait_until_quiet()
                    key, side = shape_key(shape, eos), f"{config.label}@{policy}"
                    wall = fleet_load(fleet, policy, workflows, arrivals(len(workflows), rate, seed=1), eos)["wall_s"]
                    tuning.setdefault(key, {})[side] = wall
                    log(f"vLLM tuning, {key}, {side}: {wall:.2f} s")
        fleet.close()
    best = {key: min(walls, key=walls.get) for key, walls in tuning.items()}
    return {label: start(configs[label]) for label in {b.split("@")[0] for b in best.values()}}, best

