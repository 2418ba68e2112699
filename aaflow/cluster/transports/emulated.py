"""Link emulator: a transport wrapper that caps bandwidth and adds latency.

`get_transport("ray@10Gbps")` or `get_transport("nixl@25Gbps,20us")` returns an
`EmulatedLink` over the named base transport, so one machine can play a 1, 10, 25 or
100 Gbps link and cross the transfer-vs-recompute crossover for real. The spec form is
`BASE@BANDWIDTH[,LATENCY]`, parsed by `aaflow.costmodel.units`: bandwidth in bits (`25Gbps`,
`100 Mbps`, `25Gb/s`) or bytes (`3GB/s`, `3GBps`, `1.5GiB/s`) per second, or a bare number
of bytes/s; latency `10ns`, `50us`, `50µs`, `1ms`, `0.2s`, or a bare number of seconds.
"""

from __future__ import annotations

import time

import torch

from aaflow.common.errors import KVTransferError
from aaflow.costmodel.units import parse_bandwidth, parse_duration

from .base import TransferHandle, Transport

SPEC_FORM = "'BASE@BANDWIDTH[,LATENCY]', e.g. 'ray@10Gbps' or 'nixl@1GB/s,50us'"


def parse_link_spec(spec: str) -> tuple[str, float, float]:
    """`"nixl@1Gbps,50us"` -> `("nixl", 1.25e8, 5e-05)`: base name, bytes/s, latency seconds.

    Raises ValueError naming the spec and the accepted form."""
    try:
        base, sep, link = spec.partition("@")
        if not sep or not base.strip() or "@" in link:
            raise ValueError("expected exactly one '@' after a transport name")
        bandwidth, _, latency = link.partition(",")
        bytes_per_s = parse_bandwidth(bandwidth)
        latency_s = parse_duration(latency) if latency else 0.0
    except ValueError as err:  # costmodel's CostModelError is a ValueError
        raise ValueError(f"bad link spec {spec!r} ({err}); expected {SPEC_FORM}") from None
    return base.strip(), bytes_per_s, latency_s


class EmulatedLink(Transport):
    """A base transport slowed down to a link of given bandwidth and latency.

    `expose`, `release`, `register_pool`, `unregister_pool` and `close` delegate to the
    base (handles are the base's, so a plain base endpoint can expose and this one fetch).
    `fetch` does the real fetch through the base, then sleeps the remainder so the whole
    fetch lasts at least `latency_s + nbytes / bandwidth_bytes_per_s`; its stats carry this
    link's `name` and the emulated wall time. An emulator can only slow a link down: if
    the real transfer is already slower than the cap, there is no sleep. Each fetch is
    capped on its own (concurrent fetches do not share the bandwidth). If the emulated
    time would pass the fetch's deadline, it waits until the deadline and raises
    KVTransferError, like a real link that timed out.
    """

    name = "emulated"

    def __init__(
        self,
        base: Transport,
        bandwidth_bytes_per_s: float = float("inf"),
        latency_s: float = 0.0,
        name: str | None = None,
    ) -> None:
        """`base`: the transport that moves the bytes (owned: `close` closes it; `get_transport`
        creates it from a spec); `name`: defaults to e.g. `"ray@1.25e+09B/s,2e-05s"`."""
        if not bandwidth_bytes_per_s > 0 or not latency_s >= 0:
            raise ValueError(
                f"need bandwidth_bytes_per_s > 0 and latency_s >= 0, got "
                f"{bandwidth_bytes_per_s} and {latency_s}"
            )
        super().__init__()
        self._base = base
        self.base: Transport = self._base
        """The wrapped transport that really moves the bytes."""
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
        self.latency_s = float(latency_s)
        self.handle_type = self._base.handle_type
        self.name = name or f"{self._base.name}@{bandwidth_bytes_per_s:g}B/s,{latency_s:g}s"

    @property
    def num_registrations(self) -> int:
        """The base transport's memory registrations."""
        return self._base.num_registrations

    @num_registrations.setter
    def num_registrations(self, value: int) -> None:  # Transport.__init__ sets 0: ignored
        pass

    def emulated_seconds(self, nbytes: int) -> float:
        """Least wall time of a fetch of `nbytes` on this link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def expose(self, tensor: torch.Tensor) -> TransferHandle:
        return self._base.expose(tensor)

    def release(self, handle: TransferHandle) -> None:
        self._base.release(handle)

    def register_pool(self, tensor: torch.Tensor) -> None:
        self._base.register_pool(tensor)

    def unregister_pool(self, tensor: torch.Tensor) -> None:
        self._base.unregister_pool(tensor)

    def close(self) -> None:
        self._base.close()
        self._closed = True

    def _check_handle(self, handle: object, out: torch.Tensor) -> None:
        if self._closed:
            raise KVTransferError(f"{self.name}: transport is closed; create a new one")
        self._base._check_handle(handle, out)  # handles are the base's

    def _fetch(self, handle: TransferHandle, out: torch.Tensor, deadline: float) -> None:
        start = time.monotonic()
        self._base._fetch(handle, out, deadline)
        done_at = start + self.emulated_seconds(handle.nbytes)
        wake_at = min(done_at, deadline)
        while (remaining := wake_at - time.monotonic()) > 0:
            time.sleep(remaining)
        if done_at > deadline:
            raise KVTransferError(
                f"{self.name}: fetch of {handle.nbytes} bytes (handle {handle.handle_id}) "
                f"needs {self.emulated_seconds(handle.nbytes):.3f} s on this link: timed out"
            )

