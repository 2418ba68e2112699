"""`aaflow bench crossover`: transfer vs recompute across emulated links, measured and predicted
(AAFLOW+ exp3).

A context of C tokens is materialized on replica 0. Replica 1 needs it to answer a question:
either the KV comes over a link (`af.transfer` through `ray@<bandwidth>`, the link emulator
capping the real Ray transport) and replica 1 prefills only the question, or replica 1
recomputes the context from its tokens. Both are timed from the driver until the first token
(Ray calls included), medians of repeats, cold prefix caches. The measured crossover bandwidth
(where the two curves cross, interpolated in log bandwidth) is compared with the cost model's,
computed from this machine's calibrated profile: transfer = gather copy + link time + question
prefill after C tokens + 3 calls; recompute = prefill of C + question + 1 call.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from aaflow.benchmarks.common import log, machine_facts, write_json

QUESTION = [1000 + i for i in range(16)]


def _context(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 40000 + 2000 for i in range(n)]


def _ttft_transfer(af, cluster, src, dst, ids, link) -> float:
    kv = af.materialize(cluster, "smollm2", ids, replica=src)
    try:
        t0 = time.perf_counter()
        moved = af.transfer(kv, dst, transport=link)
        af.generate(moved, QUESTION, max_new_tokens=1)
        seconds = time.perf_counter() - t0
        af.free(moved)
    finally:
        af.free(kv)
    return seconds


def _ttft_recompute(ray, dst, ids) -> float:
    t0 = time.perf_counter()
    ray.get(dst.actor.generate_text.remote(ids + QUESTION, 1))
    return time.perf_counter() - t0


def predicted_ttft(profile, compute, kv_bytes_per_token: int, tokens: int, link) -> tuple[float, float]:
    """(transfer, recompute) seconds to the first token on the destination, from the profile."""
    nbytes = tokens * kv_bytes_per_token
    overhead = profile.call_overhead_s
    transfer = (nbytes / profile.memcpy_bytes_per_s + link.transfer_time(nbytes)
                + compute.prefill_time(len(QUESTION), tokens) + 3 * overhead)
    recompute = compute.prefill_time(tokens + len(QUESTION)) + overhead
    return transfer, recompute


def crossover(bandwidths: list[float], transfer: list[float], recompute: list[float]) -> float | None:
    """The bandwidth where transfer time meets recompute time (log-linear interpolation), or None."""
    points = sorted(zip(bandwidths, (t - r for t, r in zip(transfer, recompute))))
    for (b0, d0), (b1, d1) in zip(points, points[1:]):
        if d0 >= 0 >= d1 and d0 != d1:
            x0, x1 = math.log(b0), math.log(b1)
            return math.exp(x0 + (x1 - x0) * d0 / (d0 - d1))
    return None


def predicted_crossover(profile, compute, kv_bytes_per_token: int, tokens: int, base) -> float | None:
    """Bisection on bandwidth (bytes/s) of the predicted transfer-minus-recompute time."""
    from aaflow.costmodel.hardware import LinkProfile

    def gap(bw: float) -> float:  # the emulated link in series with the real one, as `with_emulated_link`
        link = LinkProfile(1 / (1 / bw + 1 / base.bandwidth_bytes_per_s), base.latency_s)
        t, r = predicted_ttft(profile, compute, kv_bytes_per_token, tokens, link)
        return t - r

    return bisect_bandwidth(gap, 1e5, base.bandwidth_bytes_per_s)


def bisect_bandwidth(gap, lo: float, hi: float) -> float | None:
    """The bandwidth in [lo, hi] where `gap(bandwidth)` (transfer minus recompute seconds, falling
    with bandwidth) changes sign, by bisection in log bandwidth; None where it does not in range."""
    if gap(lo) <= 0 or gap(hi) >= 0:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return math.sqrt(lo * hi)


def measure(af, ray, cluster, profile, tokens: int, mbps: list[float], repeats: int) -> dict:
    """One context length: measured and predicted TTFT per emulated bandwidth, and the crossovers."""
    from aaflow.costmodel.profile_store import model_key
    from aaflow.cluster.planning import with_emulated_link

    src, dst = cluster.replicas("smollm2")[:2]
    info = ray.get(dst.actor.info.remote())
    compute, kv_bytes = profile.compute[model_key(info)], info["bytes_per_token"]
    rows, seeds = [], iter(range(10_000))
    recompute = statistics.median(_ttft_recompute(ray, dst, _context(tokens, next(seeds))) for _ in range(repeats))
    for rate in mbps:
        link_name = f"ray@{rate:g}Mbps"
        samples = []
        for _ in range(repeats):
            ray.get([r.actor.clear_prefix_cache.remote() for r in cluster.replicas()])
            samples.append(_ttft_transfer(af, cluster, src, dst, _context(tokens, next(seeds)), link_name))
        link = with_emulated_link(profile, link_name).links[link_name]
        pred_t, pred_r = predicted_ttft(profile, compute, kv_bytes, tokens, link)
        rows.append({"link": link_name, "bandwidth_bytes_per_s": rate * 1e6 / 8,
                     "transfer_ttft_s": statistics.median(samples), "recompute_ttft_s": recompute,
                     "predicted_transfer_ttft_s": pred_t, "predicted_recompute_ttft_s": pred_r})
        log(f"C={tokens} {link_name}: transfer {rows[-1]['transfer_ttft_s']:.3f} s (pred {pred_t:.3f}) | "
            f"recompute {recompute:.3f} s (pred {pred_r:.3f})")
    bws = [r["bandwidth_bytes_per_s"] for r in rows]
    measured_x = crossover(bws, [r["transfer_ttft_s"] for r in rows], [r["recompute_ttft_s"] for r in rows])
    predicted_x = predicted_crossover(profile, compute, kv_bytes, tokens, profile.links["ray"])
    error = abs(predicted_x - measured_x) / measured_x if measured_x and predicted_x else None
    log(f"C={tokens}: crossover measured {measured_x and measured_x * 8 / 1e6:.0f} Mbps, predicted "
        f"{predicted_x and predicted_x * 8 / 1e6:.0f} Mbps, error {error if error is None else f'{error:.0%}'}")
    return {"tokens": tokens, "rows": rows, "measured_crossover_bytes_per_s": measured_x,
            "predicted_crossover_bytes_per_s": predicted_x, "crossover_error": error}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="one context length, two repeats")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="context lengths (default 512 2048)")
    p.add_argument("--mbps", type=float, nargs="+", default=[50, 100, 200, 400, 800, 1600, 3200])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/crossover.json")


def run(args) -> dict:
    import ray

    import aaflow as af
    from aaflow.cluster.calibration import calibrate

    tokens = args.tokens or ([1024] if args.quick else [512, 2048])
    repeats = 2 if args.quick else args.repeats
    cluster = af.init(replicas={"smollm2": 2}, kv_cache_bytes=2 * max(tokens) * 23040 * 4)
    try:
        log("calibrating this machine in the same run (the cost model's input) ...")
        profile = calibrate(cluster, quick=True, transports=("ray",), progress=log)
        results = [measure(af, ray, cluster, profile, n, args.mbps, repeats) for n in tokens]
    finally:
        cluster.shutdown()
    report = {"benchmark": "crossover", "machine": machine_facts(), "settings": {"tokens": tokens, "mbps": args.mbps,
              "repeats": repeats}, "profile": profile.to_dict(), "contexts": results}
    write_json(args.out, report)
    _plot(report, args.out)
    return report


def _plot(report: dict, json_path: str) -> None:
    from aaflow.benchmarks.plots import write_plot

    panels = []
    for ctx in report["contexts"]:
        mbps = [r["bandwidth_bytes_per_s"] * 8 / 1e6 for r in ctx["rows"]]
        panels.append({
            "title": f"C = {ctx['tokens']} tokens", "xlabel": "emulated link (Mbps)", "ylabel": "TTFT (s)",
            "logx": True, "logy": True,
            "series": {"transfer, measured": dict(zip(mbps, (r["transfer_ttft_s"] for r in ctx["rows"]))),
                       "transfer, predicted": dict(zip(mbps, (r["predicted_transfer_ttft_s"] for r in ctx["rows"])))},
            "hlines": {"recompute, measured": ctx["rows"][0]["recompute_ttft_s"],
                       "recompute, predicted": ctx["rows"][0]["predicted_recompute_ttft_s"]},
        })
    write_plot(json_path, panels, suptitle="KV transfer vs recompute (SmolLM2, this machine)")
