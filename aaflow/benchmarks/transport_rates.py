"""The raw transports' part of `aaflow bench transfer`: bandwidth and latency of each KV transport.

For each transport, between two processes (two Ray actors; `local` runs in-process):
- fetch of a 64 MiB tensor into a warm, preallocated `out` (median of `--repeats` after
  `--warmup`), and the source-side `expose` time of the same tensor (for `ray` that is
  the copy into the object store; for `nixl` a registration);
- latency of a small (4 KiB) fetch, same protocol;
plus in-process `torch.copy_` into a preallocated buffer: the physical bound here, measured
at the start and again right before each transport ("of memcpy" uses the latter: this
machine is shared, and ratios are only meaningful side by side).
Each fetched tensor is checked bit for bit once; `print_table` shows the results.
"""

from __future__ import annotations

import statistics
import time
from importlib import metadata

import ray
import torch

from aaflow.cluster.transports import available_transports, get_transport
from aaflow.cluster.transports.base import as_bytes


class BenchPeer:
    """A transport endpoint holding one source tensor and one preallocated `out` per size."""

    def __init__(self, name: str) -> None:
        self.transport = get_transport(name)
        self.sources: dict[int, torch.Tensor] = {}
        self.outs: dict[int, torch.Tensor] = {}

    def expose(self, nbytes: int):
        """Expose the (cached) source tensor of `nbytes`; returns (handle, seconds)."""
        if nbytes not in self.sources:
            self.sources[nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        start = time.perf_counter()
        handle = self.transport.expose(self.sources[nbytes])
        return handle, time.perf_counter() - start

    def release(self, handle) -> None:
        self.transport.release(handle)

    def checksum(self, nbytes: int, which: str) -> int:
        tensor = (self.sources if which == "source" else self.outs)[nbytes]
        return int(as_bytes(tensor).view(torch.int64).sum())

    def fetch(self, handle) -> float:
        """Fetch into the warm `out` of this size; returns the fetch's own seconds."""
        out = self.outs.get(handle.nbytes)
        if out is None:
            out = self.outs[handle.nbytes] = torch.full((handle.nbytes,), 1, dtype=torch.uint8)
        return self.transport.fetch(handle, out, timeout_s=60.0).seconds

    def close(self) -> None:
        self.transport.close()


def _summary(samples: list[float], nbytes: int) -> dict:
    median = statistics.median(samples)
    return {
        "nbytes": nbytes,
        "median_s": median,
        "samples_s": samples,
        "bandwidth_bytes_per_s": nbytes / median,
    }


def memcpy_bound(nbytes: int, repeats: int, warmup: int) -> dict:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    samples = []
    warmup = max(warmup, 3)  # the first copies in a process pay page faults and thread start-up
    for i in range(warmup + repeats):
        start = time.perf_counter()
        dst.copy_(src)
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return _summary(samples, nbytes) | {"threads": torch.get_num_threads()}


def bench_pair(source, destination, call, nbytes: int, repeats: int, warmup: int) -> dict:
    handle, _ = call(source.expose, nbytes)
    fetch_s = [call(destination.fetch, handle) for _ in range(warmup + repeats)][warmup:]
    exact = call(source.checksum, nbytes, "source") == call(destination.checksum, nbytes, "out")
    call(source.release, handle)
    expose_s = []
    for _ in range(repeats):
        handle, seconds = call(source.expose, nbytes)
        expose_s.append(seconds)
        call(source.release, handle)
    return {
        "fetch": _summary(fetch_s, nbytes),
        "expose": _summary(expose_s, nbytes),
        "exact": exact,
    }


def run_transport(name: str, nbytes: int, small_bytes: int, repeats: int, warmup: int) -> dict:
    if name == "local":
        source, destination = BenchPeer(name), BenchPeer(name)
        call = lambda method, *a: method(*a)  # noqa: E731
    else:
        actor = ray.remote(BenchPeer).options(num_cpus=0)
        source, destination = actor.remote(name), actor.remote(name)
        call = lambda method, *a: ray.get(method.remote(*a), timeout=300)  # noqa: E731
    try:
        large = bench_pair(source, destination, call, nbytes, repeats, warmup)
        small = bench_pair(source, destination, call, small_bytes, repeats, warmup + 2)
    finally:
        for peer in (source, destination):
            call(peer.close)
        if name != "local":
            for peer in (source, destination):
                ray.kill(peer)
    return {"large": large, "small": small}


def _versions() -> dict:
    found = {}
    for package in ["torch", "ray", "nixl", "ucxx-cu12", "numpy"]:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def measure_transports(names: list[str], size_mib: int, small_bytes: int, repeats: int, warmup: int) -> dict:
    """Every transport of `names` between two fresh peers (Ray must already run where one is not
    `local`), each next to a memcpy measured right before it: the machine is shared and noisy."""
    results = {"params": {"size_mib": size_mib, "small_bytes": small_bytes, "repeats": repeats, "warmup": warmup},
               "available": available_transports(), "versions": _versions(),
               "memcpy": memcpy_bound(size_mib * 2**20, repeats, warmup), "transports": {}}
    for name in names:
        bound = memcpy_bound(size_mib * 2**20, repeats, warmup)
        results["transports"][name] = run_transport(name, size_mib * 2**20, small_bytes, repeats, warmup)
        results["transports"][name]["memcpy_alongside"] = bound
    return results


def print_table(results: dict) -> None:
    bound = results["memcpy"]["bandwidth_bytes_per_s"]
    size = results["params"]["size_mib"]
    small = results["params"]["small_bytes"]
    print(
        f"{'transport':<10} {f'fetch {size} MiB':>16} {'of memcpy':>10} {f'expose {size} MiB':>16} "
        f"{f'latency {small} B':>16} {'exact':>6}"
    )
    print(f"{'memcpy':<10} {bound / 1e9:>11.2f} GB/s {'100%':>10} {'':>16} {'':>16} {'':>6}")
    for name, r in results["transports"].items():
        fetch, expose, lat = r["large"]["fetch"], r["large"]["expose"], r["small"]["fetch"]
        exact = r["large"]["exact"] and r["small"]["exact"]
        alongside = r["memcpy_alongside"]["bandwidth_bytes_per_s"]
        bandwidth = fetch["bandwidth_bytes_per_s"]
        print(
            f"{name:<10} {bandwidth / 1e9:>11.2f} GB/s {bandwidth / alongside:>10.0%} "
            f"{expose['median_s'] * 1e3:>13.2f} ms {lat['median_s'] * 1e6:>13.0f} us "
            f"{str(exact):>6}   (memcpy alongside {alongside / 1e9:.2f} GB/s)"
        )
