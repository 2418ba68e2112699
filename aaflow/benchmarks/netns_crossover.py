"""`aaflow bench netns-crossover`: transfer vs recompute across real rate-limited links between
network namespaces, measured against the cost model's prediction (issue 26, part 5).

`aaflow.cluster.netns.NetnsTestbed` makes two namespaced hosts joined by a veth link through a bridge,
each running a Ray node with one CPU, and this driver runs inside host 0. One replica of the
model sits on each node (STRICT_SPREAD). For every link rate (`tc tbf` on both ends of each link)
it measures the link's achieved throughput (one bulk TCP stream, `aaflow.cluster.netns_link.measure_link`),
then, for every context length C and transport (ray, nixl and ucx over UCX_TLS=tcp on the veth):
the KV of C tokens is materialized on the source replica and moved to the destination
(`af.transfer`), which prefills a 16-token question after it (transfer TTFT); against that, the
destination recomputes context + question from tokens (recompute TTFT). Both are timed from the
driver until the first token, cold prefix caches, medians of repeats.

Prediction: the cost model (`aaflow.benchmarks.crossover_bench.predicted_ttft`) with this run's quick
calibration (prefill rates, memcpy, call overhead, each transport's ceiling and latency measured on
the unlimited veth link) and the *measured* link throughput, the link in series with the
transport's ceiling. The crossover (where transfer and recompute meet, interpolated in log link
throughput) is reported measured and predicted per context length and transport.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from aaflow.benchmarks.common import log, machine_facts, write_json
from aaflow.benchmarks.crossover_bench import QUESTION, _context, _ttft_recompute, bisect_bandwidth, crossover, predicted_ttft

DEFAULT_MBPS = [25, 50, 100, 300, 1000, 10000]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="C=1024, 50/1000/10000 Mbps, two repeats")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="context lengths (default 512 2048)")
    p.add_argument("--mbps", type=float, nargs="+", default=None, help=f"link rates (default {DEFAULT_MBPS})")
    p.add_argument("--transports", nargs="+", default=None, help="default: ray, nixl, ucx where installed")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/netns_crossover.json")


def run(args) -> dict:
    """Build the testbed, run the measurements inside host 0, tear everything down."""
    from aaflow.cluster.netns import NetnsTestbed
    from aaflow.cluster.netns_layout import available
    from aaflow.cluster.transports import available_transports

    ok, why = available()
    if not ok:
        log(f"skipped: {why}")
        return {"benchmark": "netns-crossover", "skipped": why}
    ready = available_transports()
    settings = {"tokens": args.tokens or ([1024] if args.quick else [512, 2048]),
                "mbps": args.mbps or ([50, 1000, 10000] if args.quick else DEFAULT_MBPS),
                "transports": args.transports or [t for t in ("ray", "nixl", "ucx") if ready.get(t) is True],
                "model": args.model, "repeats": 2 if args.quick else args.repeats,
                "out": os.path.abspath(args.out)}
    with NetnsTestbed(hosts=2, rate_mbit=None, node_cpus=1, object_store_bytes=1 << 30) as testbed:
        drive_inside(testbed, "aaflow.benchmarks.netns_crossover", settings)
    with open(settings["out"]) as f:
        report = json.load(f)
    _plot(report, settings["out"])
    return report


def drive_inside(testbed, module: str, settings: dict) -> None:
    """Run `python -m module <settings as JSON>` inside host 0 of the started `testbed`, to its end."""
    log(f"testbed up: {[h.netns + ' ' + h.address for h in testbed.layout.hosts]}, Ray at "
        f"{testbed.layout.ray_address}")
    proc = testbed.popen(0, [sys.executable, "-m", module, json.dumps(settings)])
    if proc.wait() != 0:
        raise RuntimeError(f"the driver inside {testbed.layout.hosts[0].netns} failed ({proc.returncode})")


def _node_ip(ray, actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()), timeout=60)


def _transfer_ttft(af, ray, cluster, kv, dst, transport: str) -> float:
    """Driver-side seconds from `af.transfer` of `kv` to the first token of the question on `dst`."""
    ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])
    t0 = time.perf_counter()
    moved = af.transfer(kv, dst, transport=transport)
    af.generate(moved, QUESTION, max_new_tokens=1)
    seconds = time.perf_counter() - t0
    af.free(moved)
    return seconds


def link_bytes(rate_mbit: float) -> int:
    """About a second of traffic at the nominal rate, 8..256 MiB."""
    return int(min(256 << 20, max(8 << 20, rate_mbit * 1e6 / 8)))


def _series(link_bw: float, ceiling: float) -> float:
    return 1 / (1 / link_bw + 1 / ceiling)


def predicted_crossover(profile, compute, kv_bytes: int, tokens: int, base) -> float | None:
    """The link throughput (bytes/s) where predicted transfer meets recompute, the link in series
    with the transport's ceiling `base` (bisection), or None where it does not cross in 0.1 MB/s..1 TB/s."""
    from aaflow.costmodel.hardware import LinkProfile

    def gap(bw: float) -> float:
        link = LinkProfile(_series(bw, base.bandwidth_bytes_per_s), base.latency_s, base.in_place)
        t, r = predicted_ttft(profile, compute, kv_bytes, tokens, link)
        return t - r

    return bisect_bandwidth(gap, 1e5, 1e12)


def inside(settings: dict) -> dict:
    """The measurements, run inside host 0 of the testbed (its layout in $AAFLOW_NETNS_LAYOUT)."""
    import ray

    import aaflow as af
    from aaflow.cluster.calibration import calibrate
    from aaflow.costmodel.profile_store import model_key
    from aaflow.cluster.netns_layout import DEVICE, Layout, set_rate
    from aaflow.cluster.netns_link import measure_link
    from aaflow.costmodel.hardware import LinkProfile

    layout = Layout.from_json(os.environ["AAFLOW_NETNS_LAYOUT"])
    tokens, transports, repeats = settings["tokens"], settings["transports"], settings["repeats"]
    cluster = af.init(replicas={settings["model"]: 2}, address=layout.ray_address, placement_strategy="STRICT_SPREAD",
                      num_cpus=2, kv_cache_bytes=3 * max(tokens) * 23040 * 4, placement_timeout_s=120,
                      actor_env={"UCX_NET_DEVICES": DEVICE, "UCX_TLS": "tcp", "GLOO_SOCKET_IFNAME": DEVICE})
    try:
        replicas = cluster.replicas(settings["model"])
        where = {r.name: _node_ip(ray, r.actor) for r in replicas}
        src, dst = sorted(replicas, key=lambda r: where[r.name])  # source on host 0, destination on host 1
        assert where[src.name] != where[dst.name], f"both replicas on one node: {where}"
        log(f"replicas: {where}")
        set_rate(layout, None)
        log("calibrating over the unlimited veth link (prefill rates, memcpy, calls, transport ceilings) ...")
        profile = calibrate(cluster, quick=True, transports=tuple(transports), progress=log)
        unlimited = statistics.median(measure_link(layout, 0, 1, 256 << 20) for _ in range(3))
        log(f"link without tbf: {unlimited * 8 / 1e6:.0f} Mbit/s achieved (one TCP stream)")
        info = ray.get(dst.actor.info.remote())
        compute, kv_bytes = profile.compute[model_key(info)], info["bytes_per_token"]
        seeds, rates = iter(range(10_000)), []
        for rate in settings["mbps"]:
            set_rate(layout, rate)
            link_bw = statistics.median(measure_link(layout, 0, 1, link_bytes(rate)) for _ in range(3))
            log(f"link at tbf {rate:g} Mbit/s: {link_bw * 8 / 1e6:.0f} Mbit/s achieved (one TCP stream)")
            contexts = []
            for n in tokens:
                recompute = statistics.median(_ttft_recompute(ray, dst, _context(n, next(seeds)))
                                              for _ in range(repeats))
                samples: dict[str, list[float]] = {t: [] for t in transports}
                for _ in range(repeats):
                    kv = af.materialize(cluster, settings["model"], _context(n, next(seeds)), replica=src)
                    try:
                        for t in transports:
                            samples[t].append(_transfer_ttft(af, ray, cluster, kv, dst, t))
                    finally:
                        af.free(kv)
                row = {"tokens": n, "kv_bytes": n * kv_bytes, "recompute_ttft_s": recompute, "transports": {}}
                for t in transports:
                    base = profile.links[t]
                    link = LinkProfile(_series(link_bw, base.bandwidth_bytes_per_s), base.latency_s, base.in_place)
                    pred_t, pred_r = predicted_ttft(profile, compute, kv_bytes, n, link)
                    row["transports"][t] = {"transfer_ttft_s": statistics.median(samples[t]), "samples": samples[t],
                                            "predicted_transfer_ttft_s": pred_t, "predicted_recompute_ttft_s": pred_r}
                    log(f"  C={n} {t}: transfer {row['transports'][t]['transfer_ttft_s']:.3f} s (pred {pred_t:.3f}) "
                        f"| recompute {recompute:.3f} s (pred {pred_r:.3f})")
                contexts.append(row)
            rates.append({"tbf_mbit": rate, "link_bytes_per_s": link_bw, "contexts": contexts})
    finally:
        set_rate(layout, None)
        cluster.shutdown()
    crossovers = []
    for i, n in enumerate(tokens):
        for t in transports:
            bws = [r["link_bytes_per_s"] for r in rates]
            rows = [r["contexts"][i] for r in rates]
            measured = crossover(bws, [r["transports"][t]["transfer_ttft_s"] for r in rows],
                                 [r["recompute_ttft_s"] for r in rows])
            predicted = predicted_crossover(profile, compute, kv_bytes, n, profile.links[t])
            err = abs(predicted - measured) / measured if measured and predicted else None
            crossovers.append({"tokens": n, "transport": t, "measured_crossover_bytes_per_s": measured,
                               "predicted_crossover_bytes_per_s": predicted, "crossover_error": err})
            log(f"C={n} {t}: crossover measured {_mbit(measured)}, predicted {_mbit(predicted)}"
                + (f", error {err:.0%}" if err is not None else ""))
    report = {"benchmark": "netns-crossover", "machine": machine_facts(), "settings": settings,
              "replicas": where,
              "unlimited_link_bytes_per_s": unlimited, "profile": profile.to_dict(), "rates": rates, "crossovers": crossovers}
    write_json(settings["out"], report)
    return report


def _mbit(bw: float | None) -> str:
    return "none in range" if bw is None else f"{bw * 8 / 1e6:.0f} Mbit/s"


def _plot(report: dict, json_path: str) -> None:
    from aaflow.benchmarks.plots import write_plot

    panels = []
    for i, n in enumerate(report["settings"]["tokens"]):
        xs = [round(r["link_bytes_per_s"] * 8 / 1e6) for r in report["rates"]]
        rows = [r["contexts"][i] for r in report["rates"]]
        first = report["settings"]["transports"][0]
        series = {"recompute, measured": dict(zip(xs, (r["recompute_ttft_s"] for r in rows))),
                  "recompute, predicted": dict(zip(xs, (r["transports"][first]["predicted_recompute_ttft_s"]
                                                        for r in rows)))}
        for t in report["settings"]["transports"]:
            series[f"{t}, measured"] = dict(zip(xs, (r["transports"][t]["transfer_ttft_s"] for r in rows)))
            series[f"{t}, predicted"] = dict(zip(xs, (r["transports"][t]["predicted_transfer_ttft_s"] for r in rows)))
        panels.append({"title": f"C = {n} tokens", "xlabel": "measured link throughput (Mbit/s)", "ylabel": "TTFT (s)",
                       "logx": True, "logy": True, "series": series})
    write_plot(json_path, panels, suptitle="KV transfer vs recompute across network namespaces (tbf-limited veth)")


if __name__ == "__main__":
    inside(json.loads(sys.argv[1]))
