"""`aaflow bench serve --replicas N --hosts netns --link-rates R ...`: the replicas on separate hosts.

`aaflow.cluster.netns.NetnsTestbed` makes N namespaced hosts joined by veth links through a bridge,
each running a Ray node of one CPU; this driver runs inside host 0. Per link rate (`tc tbf` on both
ends of every link, Mbit/s):
* the link's achieved throughput (one bulk TCP stream, `measure_link`);
* the links between two replicas measured again over it (`calibrate_links`: the machine's compute
  entries kept), written to the profile the deployment plans with ($AAFLOW_HARDWARE_PROFILE, set on
  every Ray node of the testbed), and the deployment started again so that its loop reads it: as a
  user calibrates a cluster on its own network;
* aaflow: an `af.up` deployment of N SmolLM2 replicas, one per host (STRICT_SPREAD, one torch thread
  each), through three `aaflow serve` endpoints that differ only in `--prefix-fetch`: `auto` (the
  cost model moves a shared document's KV to the replica that lacks it, or computes it there),
  `move` (always moved) and `compute` (always computed);
* vLLM: N `vllm serve`, instance i inside host i on core i, behind `vllm-router` in host 0; its
  router policy and configuration tuned once on the unlimited link (every request crosses the link
  as text only, a few kB), the kept fleet measured at every rate.
Clients (`http_load.run_http`, the official `openai` package) run in host 0. Repeats alternate the
four sides; medians per side. Every KV move is listed with the cost model's predicted seconds
beside the measured ones (`prefix_decisions`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import types
from dataclasses import asdict
from pathlib import Path

from aaflow.benchmarks.common import log, machine_facts, write_json
from aaflow.benchmarks.serve_shapes import arrivals, shape_key, warm_up_load

FETCHES = ("auto", "move", "compute")  # `aaflow serve --prefix-fetch` of each aaflow side
LINK_TOKENS = (128, 512, 1024)  # the sizes the links are measured at (a document is ~700 tokens)
SETTLE_S = 2.0  # after a link rate changes, before measuring it


def run_netns(args, report: dict) -> dict:
    """Build the testbed, run the measurements inside host 0, tear everything down; the report."""
    from aaflow.benchmarks.netns_crossover import drive_inside
    from aaflow.cluster.netns import NetnsTestbed
    from aaflow.cluster.netns_layout import available
    from aaflow.costmodel.profile_store import PROFILE_ENV

    ok, why = available()
    if not ok:
        log(f"skipped: {why}")
        return {**report, "skipped": why}
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    settings.update(out=os.path.abspath(args.out), report=report)
    with tempfile.TemporaryDirectory(prefix="aaflow-netns-profile-") as folder:
        profile = Path(folder) / "deployment.yaml"  # the profile the deployment plans with, per rate
        with NetnsTestbed(hosts=args.replicas, rate_mbit=None, node_cpus=1, object_store_bytes=1 << 30,
                          env={PROFILE_ENV: str(profile)}) as testbed:
            drive_inside(testbed, "aaflow.benchmarks.serve_netns", settings)
    with open(settings["out"]) as f:
        return json.load(f)


def inside(settings: dict) -> dict:
    """The measurements, inside host 0 of the testbed (its layout in $AAFLOW_NETNS_LAYOUT)."""
    from aaflow.benchmarks.serve_shapes import loads_and_shapes
    from aaflow.benchmarks.serve_replicas import tune_fleet
    from aaflow.cluster.netns_layout import Layout, set_rate
    from aaflow.engine.kv_budget import default_kv_cache_bytes, parse_bytes

    report, out = settings.pop("report"), settings["out"]
    args = argparse.Namespace(**settings)
    layout = Layout.from_json(os.environ["AAFLOW_NETNS_LAYOUT"])
    args.fleet_hosts = [(h.netns, h.address) for h in layout.hosts]
    loads, shapes = loads_and_shapes(args)
    kv_bytes = parse_bytes(args.kv_cache_bytes) if args.kv_cache_bytes else default_kv_cache_bytes(args.replicas)
    report.update(machine=machine_facts(), hosts=[{"netns": h.netns, "address": h.address} for h in layout.hosts],
                  rates=[])
    set_rate(layout, None)
    fleets, best = tune_fleet(args, loads, shapes, kv_bytes, report) if args.vllm else ({}, {})
    deployment = Deployment(layout, args, kv_bytes)
    try:
        for rate in args.link_rates:
            report["rates"].append(_at_rate(args, layout, deployment, rate, loads, shapes, fleets, best, report))
            write_json(out, report)  # what is measured so far survives a later failure
    finally:
        deployment.close()
        for fleet in fleets.values():
            fleet.close()
        set_rate(layout, None)
    return report


def _at_rate(args, layout, deployment: "Deployment", rate: float, loads: dict, shapes: list, fleets: dict,
             best: dict, report: dict) -> dict:
    import time

    from aaflow.benchmarks.netns_crossover import link_bytes
    from aaflow.benchmarks.serve_replicas import aaflow_http_load, alternating_loads, fleet_load
    from aaflow.benchmarks.serve_sides import medians
    from aaflow.cluster.netns_layout import set_rate
    from aaflow.cluster.netns_link import measure_link

    set_rate(layout, rate)
    time.sleep(SETTLE_S)
    link = statistics.median(measure_link(layout, 0, 1, link_bytes(rate)) for _ in range(2))
    log(f"link at tbf {rate:g} Mbit/s: {link * 8 / 1e6:.0f} Mbit/s achieved (one TCP stream)")
    links = deployment.recalibrate()
    row = {"tbf_mbit": rate, "link_bytes_per_s": link, "calibrated_links": links, "shapes": {}}
    for ignore_eos, workflows in loads.items():
        for shape, arrival_rate in shapes:
            key = shape_key(shape, ignore_eos)
            offsets = arrivals(len(workflows), arrival_rate, seed=1)
            sides = [f"aaflow:{f}" for f in FETCHES] + ([best[key]] if key in best else [])

            def load(side: str) -> dict:
                if side.startswith("aaflow:"):
                    clients = deployment.endpoints[side.split(":")[1]].clients(ignore_eos)
                    return aaflow_http_load(deployment.cluster, workflows, offsets, "auto", clients)
                label, policy = side.split("@")
                return fleet_load(fleets[label], policy, workflows, offsets, ignore_eos)

            samples = alternating_loads(sides, args.repeats, load, f"{rate:g} Mbit/s, {key}", len(workflows))
            row["shapes"][key] = verdicts({side: medians(v) for side, v in samples.items()},
                                          report.get("vllm_tuning", {}).get(key))
            log(f"{rate:g} Mbit/s, {key}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["shapes"][key].items()
                                                       if isinstance(v, float)))
    return row


def verdicts(sides: dict, tuning: dict | None) -> dict:
    """The sides' medians and the targets' ratios: `auto` against the better of always-move and
    always-compute (>= 1 is at least as fast), and against vLLM behind its router (throughput)."""
    out = {"sides": sides, "vllm_tuning_wall_s": tuning or {}}
    wall = {k: v["wall_s"] for k, v in sides.items()}
    fixed = min(wall["aaflow:move"], wall["aaflow:compute"])
    out["auto_vs_best_fixed"] = fixed / wall["aaflow:auto"]
    vllm = [k for k in sides if not k.startswith("aaflow:")]
    if vllm:
        out["vllm_side"] = vllm[0]
        out["throughput_ratio"] = wall[vllm[0]] / wall["aaflow:auto"]
        for q in ("latency_p50_s", "latency_p99_s"):
            if q in sides["aaflow:auto"] and q in sides[vllm[0]]:
                out[f"{q}_ratio"] = sides["aaflow:auto"][q] / sides[vllm[0]][q]
    return out


class Deployment:
    """aaflow's side: `af.up` of the replicas, one per testbed host, and one `aaflow serve` per
    `FETCHES`; `recalibrate()` measures the links again, writes the profile the deployment plans
    with, and starts it again (its loop reads the profile once)."""

    def __init__(self, layout, args, kv_bytes: int) -> None:
        from aaflow.cluster.replica_api import default_transport
        from aaflow.costmodel.profile_store import PROFILE_ENV, default_profile_name, find_profile

        self.layout, self.args, self.kv_bytes = layout, args, kv_bytes
        self.profile_path = Path(os.environ[PROFILE_ENV])
        self.transport = default_transport({"builtin"})
        self.base = find_profile(default_profile_name())  # the machine's compute (one core a replica)
        self.cluster, self.endpoints = None, {}
        if self.base is not None:
            self.base.save(self.profile_path)
        self._start()

    def _start(self) -> None:
        import aaflow as af
        from aaflow.benchmarks.http_load import HttpEndpoint
        from aaflow.benchmarks.serve_replicas import warm_links
        from aaflow.benchmarks.serve_sides import aaflow_load
        from aaflow.cluster.netns_layout import DEVICE

        log(f"aaflow: af.up of {self.args.replicas} replicas, one per host ...")
        self.cluster = af.up({"smollm2": self.args.replicas}, address=self.layout.ray_address, dtype=self.args.dtype,
                             num_cpus=self.args.replicas, placement_strategy="STRICT_SPREAD", placement_timeout_s=120,
                             kv_cache_bytes=self.kv_bytes,
                             actor_env={"UCX_NET_DEVICES": DEVICE, "UCX_TLS": "tcp", "GLOO_SOCKET_IFNAME": DEVICE})
        head = types.SimpleNamespace(address=self.layout.ray_address, env=dict(os.environ))
        self.endpoints = {f: HttpEndpoint(head, serve_args=("--prefix-fetch", f)) for f in FETCHES}
        aaflow_load(self.cluster, warm_up_load(), [0.0], "auto", None, self.endpoints["auto"].clients(True))
        warm_links(self.cluster)

    def recalibrate(self) -> dict:
        """The links measured over the link as it is now; the deployment restarted on them."""
        from aaflow.cluster.calibration import calibrate, calibrate_links

        if self.base is None:  # no profile of this machine: calibrate everything once
            self.base = calibrate(self.cluster, quick=True, transports=(self.transport,), progress=log)
        profile = calibrate_links(self.cluster, self.base, (self.transport,), LINK_TOKENS, progress=log)
        profile.save(self.profile_path)
        self.close()
        self._start()
        return {self.transport: asdict(profile.links[self.transport])}

    def close(self) -> None:
        """Stop the endpoints and take the deployment down (the Ray nodes stay)."""
        import aaflow as af

        for endpoint in self.endpoints.values():
            endpoint.close()
        self.endpoints = {}
        if self.cluster is not None:
            self.cluster.shutdown()
            af.down(self.layout.ray_address)
            self.cluster = None


if __name__ == "__main__":
    inside(json.loads(sys.argv[1]))
