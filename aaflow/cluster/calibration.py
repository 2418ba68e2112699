"""`aaflow calibrate`: measure this cluster's replicas and links, fit a hardware profile.

Each model's compute (prefill by new tokens and context, decode step by batch and context) is
measured on one of its replicas, in its actor, with the replica's own threads; links are measured
with real transfers between two replicas of one model, through every transport that runs here;
the driver measures the cost of one replica call. `aaflow.costmodel.fitting` fits the samples;
`aaflow.costmodel.profile_store` keeps the profiles.
A compute entry is keyed by `model_key` (model, dtype, threads): profiles of other settings differ.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from aaflow.cluster.calibration_cores import concurrency_slowdown, lent_core_speedup, say
from aaflow.common.errors import CostModelError
from aaflow.common.machine import cpu_kind, cpu_model
from aaflow.common.progress import Stages
from aaflow.cluster.replica_calls import call
from aaflow.runtime.calls import ExposeCall, FreeCall, MaterializeCall, ReleaseCall
from aaflow.runtime.probe_calls import (CalibrateDecodeCall, CalibratePackingCall, CalibratePrefillCall, CalibrateReceiveCall,
                                       InfoCall, MemcpyBandwidthCall, SessionCountCall)
from aaflow.cluster.replica_microbench import FULL_DECODE, FULL_PREFILL, QUICK_DECODE, QUICK_PREFILL
from aaflow.cluster.transports import available_transports
from aaflow.cluster.transports.registry import moves_in_place
from aaflow.costmodel.fitting import compute_profile_from_samples, fit_link, fit_quality, with_member_cost
from aaflow.costmodel.hardware import HardwareProfile, LinkProfile
from aaflow.costmodel.profile_store import cached_profile_path, covers, default_profile_name, find_profile, model_key

LINK_TOKENS_QUICK = (128, 1024, 4096)
LINK_TOKENS_FULL = (64, 256, 1024, 2048, 4096, 8192)
QUICK_CALIBRATION_S = 60  # about how long a quick calibration takes per model (SmolLM2, 2 cores)
# A quick fit off by more than this (median relative error: a noisy moment, one sample per point) is
# measured again on the full grid, three samples a point.
QUICK_FIT_MAX_ERROR = 0.25


def _call_overhead_s(replica) -> float:
    samples = []
    for _ in range(20):
        t0 = time.perf_counter()
        call(replica, SessionCountCall())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _measure_links(replicas, transports, tokens, progress, memcpy_bytes_per_s: float) -> tuple[dict, dict]:
    """Real transfers of `tokens`-long KV from replicas[0] to replicas[1] per transport: the time of
    the expose call on the source and the receive (fetch + import) on the destination."""
    src, dst = replicas[0], replicas[1]
    links, samples_out = {}, {}
    info = call(src, InfoCall())
    vocab = info["vocab_size"]
    cap = info["max_tokens"]
    tokens = [n for n in tokens if n <= cap]
    if len(tokens) < 2:  # a small model or pool: sizes relative to what fits
        tokens = [max(1, cap // 8), cap]
    refs = [call(src, MaterializeCall([(7 * i + 11) % vocab for i in range(n)])) for n in tokens]
    try:
        for transport in transports:
            in_place = moves_in_place(transport)
            samples = []
            for record in refs:
                times = []
                for _ in range(4):  # the first transfer of a size allocates and registers buffers
                    t0 = time.perf_counter()
                    exposure = call(src, ExposeCall(record.id, transport))
                    exposed = time.perf_counter() - t0
                    try:
                        nbytes, seconds = call(dst, CalibrateReceiveCall(exposure.handle, exposure.shape,
                                                                         exposure.record, transport))
                    finally:
                        call(src, ReleaseCall(exposure.handle, transport))
                    # the simulator charges a staging source nbytes / memcpy for the gather; the rest is the link's
                    gather = 0.0 if in_place else nbytes / memcpy_bytes_per_s
                    times.append(max(1e-6, exposed + seconds - gather))
                samples.append((nbytes, statistics.median(times[1:])))
            try:
                links[transport] = replace(fit_link(samples), in_place=in_place)
            except CostModelError:  # too noisy to separate latency from bandwidth: no latency term
                nbytes, seconds = max(samples)
                links[transport] = LinkProfile(nbytes / seconds, 0.0, in_place)
            samples_out[transport] = samples
            say(progress, f"  link {transport}: {links[transport].bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
                           f"{links[transport].latency_s * 1e3:.2f} ms latency"
                           + (" (in place: no staging copy)" if in_place else " (after the source's staging copy)"))
    finally:
        for record in refs:
            call(src, FreeCall(record.id))
    return links, samples_out


def calibrate(cluster, name: str | None = None, quick: bool = True, transports: tuple[str, ...] | None = None,
              progress: Callable[[str], None] | None = print, out: str | Path | None = None,
              base: HardwareProfile | None = None) -> HardwareProfile:
    """Measure `cluster` and return (and save to `out`, if given) a measured `HardwareProfile`.

    Args:
        quick: a short grid (about a minute for SmolLM2 here); False measures more points.
        transports: links to measure (default: ray, nixl and ucx where they run here).
        base: a profile to extend (entries of models measured now are replaced).
    """
    name = name or default_profile_name()
    compute = dict(base.compute) if base else {}
    links = dict(base.links) if base else {}
    report = []
    pairs = [cluster.replicas(m) for m in sorted(cluster.models) if len(cluster.replicas(m)) >= 2]
    stages = Stages(3 * len(cluster.models) + 3 + bool(pairs), "calibrating", shown=progress is not None)

    def stage(message: str) -> None:
        say(progress, message)
        stages.begin(message.split(": ")[-1].rstrip(" ."))

    for model in sorted(cluster.models):
        replica = cluster.replicas(model)[0]
        info = call(replica, InfoCall())
        key = model_key(info)
        full = not quick
        while True:
            stage(f"calibrating {key} on {replica.name}: prefill ...")
            prefill = call(replica, CalibratePrefillCall(FULL_PREFILL if full else QUICK_PREFILL, 3 if full else 1))
            stage(f"calibrating {key} on {replica.name}: decode ...")
            decode = call(replica, CalibrateDecodeCall(FULL_DECODE if full else QUICK_DECODE))
            fit = compute_profile_from_samples(prefill, decode)
            quality = fit_quality(fit, prefill, decode)
            if full or quality <= QUICK_FIT_MAX_ERROR:
                break
            say(progress, f"  {key}: median fit error {quality:.1%} on the quick grid; measuring the full grid")
            stages.add(2)
            full = True
        stage(f"calibrating {key} on {replica.name}: packed prefill ...")
        compute[key] = with_member_cost(fit, call(replica, CalibratePackingCall()))
        grid = "full" if full else "quick"
        report.append(f"{key}: {len(prefill)} prefill and {len(decode)} decode points ({grid} grid), "
                      f"median fit error {quality:.1%}")
        say(progress, f"  {report[-1]}")
    stage("calibrating: replicas computing at once ...")
    slowdown = concurrency_slowdown(cluster.replicas(), progress)
    stage("calibrating: prefill on lent cores ...")
    lent_speedup = lent_core_speedup(cluster.replicas(), progress)
    stage("calibrating: memory bandwidth and call overhead ...")
    replica = cluster.replicas()[0]
    memcpy = call(replica, MemcpyBandwidthCall())
    overhead = _call_overhead_s(replica)
    if pairs:
        ready = available_transports()
        wanted = transports or tuple(t for t in ("ray", "nixl", "ucx") if ready.get(t) is True)
        stage(f"calibrating links {', '.join(wanted)} between {pairs[0][0].name} and {pairs[0][1].name} ...")
        measured, _ = _measure_links(pairs[0], wanted, LINK_TOKENS_QUICK if quick else LINK_TOKENS_FULL, progress,
                                     memcpy)
        links.update(measured)
    stages.close()
    source = (f"measured by `aaflow calibrate` on {socket.gethostname()} ({cpu_model()}, {cpu_kind()}, "
              f"{os.cpu_count()} CPUs) at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}; " + "; ".join(report))
    profile = HardwareProfile(name=name, measured=True, source=source, memcpy_bytes_per_s=memcpy, compute=compute,
                              links=links, call_overhead_s=overhead, concurrency_slowdown=slowdown,
                              lent_core_speedup=lent_speedup)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        profile.save(out)
        say(progress, f"wrote {out}")
    return profile


def calibrate_links(cluster, base: HardwareProfile, transports: tuple[str, ...] | None = None,
                    tokens: tuple[int, ...] = LINK_TOKENS_QUICK,
                    progress: Callable[[str], None] | None = print) -> HardwareProfile:
    """`base` with the links between two replicas of one model of `cluster` measured again (its
    compute entries kept): a deployment whose replicas sit on hosts joined by another network than
    the one `base` was calibrated on. Raises `CostModelError` without two replicas of one model."""
    pairs = [cluster.replicas(m) for m in sorted(cluster.models) if len(cluster.replicas(m)) >= 2]
    if not pairs:
        raise CostModelError("measuring links needs two replicas of one model")
    ready = available_transports()
    wanted = transports or tuple(t for t in ("ray", "nixl", "ucx") if ready.get(t) is True)
    say(progress, f"measuring links {', '.join(wanted)} between {pairs[0][0].name} and {pairs[0][1].name} ...")
    measured, _ = _measure_links(pairs[0], wanted, tokens, progress, base.memcpy_bytes_per_s)
    source = f"{base.source}; links {', '.join(wanted)} measured again at {time.strftime('%Y-%m-%d %H:%M:%S')}"
    return replace(base, links={**base.links, **measured}, source=source)


def ensure_profile(cluster, progress: Callable[[str], None] | None = print,
                   infos: dict[str, dict] | None = None) -> HardwareProfile:
    """This machine's profile with an entry for every model of `cluster`: loaded, or calibrated
    now (quick) for the models it lacks and saved to the cache for the next run. `infos` are the
    replicas' `info()` per model, when the caller has them already."""
    infos = infos or {m: call(cluster.replicas(m)[0], InfoCall()) for m in cluster.models}
    profile = find_profile()
    if covers(profile, infos):
        return profile
    say(progress, "no calibrated profile of this machine for these replicas yet: calibrating (quick, about "
                  f"{QUICK_CALIBRATION_S} s per model; `aaflow calibrate` does it ahead of any run) ...")
    return calibrate(cluster, quick=True, progress=progress, base=profile,
                     out=cached_profile_path(default_profile_name()))
