"""`nixl`: NIXL agents over UCX, one-sided READ of registered DRAM.

`pip install nixl` (1.5.1: nixl-cu12 + nixl-cu13 wheels, import without a GPU; they bundle
their own UCX). One NIXL agent per transport endpoint, no listener thread (nothing binds a
port): agent metadata travels out of band in the handle.

Protocol, for one fetch of handle H (exposed by agent S) into `out` on agent D:
1. S registered H's memory at `expose` (or once, for a pool given to `register_pool`);
   H carries S's partial metadata for that registration plus connection info.
2. D registers `out` (cached by address: repeated fetches into one buffer reuse it), loads
   S's metadata once per registration, and notifies S: BEGIN(H, token, D's conn info).
3. S leases H (memory stays registered until the lease ends, even if released meanwhile)
   and answers ACK(OK | GONE, address, size); a released or unknown H fails here, fast.
4. D posts a READ of H's bytes into `out` with notification DONE(H, token), and polls
   `check_xfer_state` until DONE, ERR or the deadline (then it sends ABORT and raises).

Scatter lists (`expose_segments` / `fetch_segments`): H names pieces of S's registered pool
instead of one tensor, `out` is pieces of D's registered pool, and one READ carries both
descriptor lists split at each other's boundaries (`segments.pair_up`); the ACK then carries
a digest of S's list instead of an address. A replica's KV moves pool to pool this way.

Progress: the source must keep progressing its worker for a READ to advance over UCX's
shared-memory transports; `_nixl_notifications.NotificationPoller` does it (and says how).

`_nixl_agent.AgentHost` wraps the agent (locking, sealed metadata, UCX environment).

UCX settings (defaults: the fastest measured between processes of one host over loopback):
`UCX_TLS=self,posix,sysv` with backend option `ucx_error_handling_mode=none` and
`UCX_NET_DEVICES=lo`. They are set in the environment only while the agent's UCX context
is created, and an explicit constructor argument wins over the environment, which wins
over these defaults. With error handling off a dead peer is noticed by the timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
import uuid
from collections import OrderedDict

import torch

from aaflow.common.errors import KVTransferError

from ._leases import ABORT, BEGIN, DONE, OK, LeaseTable, Message, lease_request
from ._nixl_agent import AgentHost, NixlHandle, Region
from ._nixl_notifications import ACK_PAYLOAD, NotificationPoller, run_cleanups
from .base import TransferHandle, TransferStillRunningError, Transport, _check_cpu_contiguous, package_missing
from .segments import Segments, check_inside, digest, pair_up, total_nbytes

log = logging.getLogger(__name__)


class NixlTransport(NotificationPoller, Transport):
    name = "nixl"
    handle_type = NixlHandle
    supports_segments = True

    def __init__(self, ucx_tls: str | None = None, net_devices: str | None = None, error_handling_mode: str = "none",
                 idle_poll_s: float = 0.005, max_lease_s: float = 255.0, max_cached_outs: int = 8) -> None:
        """`ucx_tls`/`net_devices`: UCX_TLS / UCX_NET_DEVICES (default env, else
        `self,posix,sysv` / `lo`); `error_handling_mode`: UCX backend option
        (`none` or `peer`); `idle_poll_s`: longest notification poll period while idle;
        `max_lease_s`: longest a reader may hold an exposure; `max_cached_outs`: receive
        buffers kept registered (LRU)."""
        super().__init__()
        self._agent = AgentHost(
            ucx_tls or os.environ.get("UCX_TLS") or "self,posix,sysv",
            net_devices or os.environ.get("UCX_NET_DEVICES") or "lo",
            error_handling_mode,
        )
        self._idle_poll_s = idle_poll_s
        self._max_lease_s = max_lease_s
        self._max_cached_outs = max_cached_outs
        self._fetch_lock = threading.Lock()  # one fetch at a time per endpoint
        self._leases = LeaseTable()
        self._pools: list[Region] = []
        self._outs: OrderedDict[tuple[int, int], Region] = OrderedDict()
        self._remote: dict[str, dict[str, tuple[int, int]]] = {}  # agent -> reg_id -> range
        self._peers: set[str] = set()  # agents we can notify
        self._acks: dict[int, Message] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # scatter exposures: handle id -> (digest, nbytes)
        self._stuck: list[tuple[object, torch.Tensor]] = []  # READs that could not be cancelled
        self._tokens = itertools.count(random.getrandbits(48))
        self._stop = threading.Event()
        self._poller = threading.Thread(
            target=self._poll_loop, name="nixl-notif-poller", daemon=True
        )
        self._poller.start()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        missing = package_missing("nixl")
        return f"{missing}; pip install nixl==1.5.1" if missing else None

    # -- registration --------------------------------------------------------------------------

    def _register(self, tensor: torch.Tensor) -> Region:
        self.num_registrations += 1
        return self._agent.register(tensor)

    def register_pool(self, tensor: torch.Tensor) -> None:
        _check_cpu_contiguous(tensor, "pool")
        if any(p.addr == tensor.data_ptr() and p.nbytes == tensor.nbytes for p in self._pools):
            return
        self._pools.append(self._register(tensor))

    def unregister_pool(self, tensor: torch.Tensor) -> None:
        key = (tensor.data_ptr(), tensor.nbytes)
        for pool in [p for p in self._pools if (p.addr, p.nbytes) == key]:
            self._pools.remove(pool)
            self._agent.deregister(pool)

    def _pool_for(self, tensor: torch.Tensor) -> Region | None:
        return next((p for p in self._pools if p.contains(tensor)), None)

    # -- source side ---------------------------------------------------------------------------

    def expose(self, tensor: torch.Tensor) -> NixlHandle:
        fields = self._new_handle_fields(tensor)
        region = self._pool_for(tensor)
        cleanup = None
        if region is None:
            region = self._register(tensor)
            cleanup = lambda region=region: self._agent.deregister(region)  # noqa: E731
        self._leases.add(fields["handle_id"], tensor, cleanup)
        return NixlHandle(
            **fields,
            agent_name=self._agent.name,
            agent_metadata=self._agent.metadata(region),
            reg_id=region.reg_id,
            reg_range=(region.addr, region.nbytes),
            addr=tensor.data_ptr(),
        )

    def expose_segments(self, pool: torch.Tensor, segments: Segments, shape: tuple[int, ...],
                        dtype: torch.dtype) -> NixlHandle:
        region = self._pool_for(pool)
        if region is None:
            raise ValueError("nixl: expose_segments needs a pool given to register_pool() first")
        check_inside(segments, region.tensor, "nixl: expose_segments")
        if self._closed:
            raise KVTransferError(f"{self.name}: transport is closed; create a new one")
        handle_id, nbytes = uuid.uuid4().hex, total_nbytes(segments)
        self._spans[handle_id] = (digest(segments), nbytes)
        self._leases.add(handle_id, pool, lambda: self._spans.pop(handle_id, None))
        return NixlHandle(
            transport=self.name, handle_id=handle_id, nbytes=nbytes, shape=tuple(shape),
            dtype=str(dtype).removeprefix("torch."), agent_name=self._agent.name,
            agent_metadata=self._agent.metadata(region), reg_id=region.reg_id,
            reg_range=(region.addr, region.nbytes), addr=segments[0][0], segments=tuple(segments),
        )

    def release(self, handle: TransferHandle) -> None:
        run_cleanups(self._leases.release(getattr(handle, "handle_id", "")))

    # -- destination side ----------------------------------------------------------------------

    def _fetch(self, handle: TransferHandle, out: torch.Tensor, deadline: float) -> None:
        with self._fetch_lock:
            self._out_region(out)
            self._read_into(handle, [(out.data_ptr(), out.nbytes)], out, deadline)

    def _fetch_segments(self, handle: TransferHandle, pool: torch.Tensor, segments: Segments,
                        deadline: float) -> None:
        if self._pool_for(pool) is None:
            raise KVTransferError("nixl: fetch_segments needs a pool given to register_pool() first")
        with self._fetch_lock:
            self._read_into(handle, segments, pool, deadline)

    def _read_into(self, handle: TransferHandle, local: Segments, keepalive: torch.Tensor,
                   deadline: float) -> None:
        """Lease the handle's exposure and READ it into `local` (registered memory). Holds the
        fetch lock."""
        assert isinstance(handle, NixlHandle)
        remote = list(handle.segments) or [(handle.addr, handle.nbytes)]
        expected = (digest(remote), handle.nbytes) if handle.segments else (handle.addr, handle.nbytes)
        self._load_peer(handle)
        token = next(self._tokens)
        span = self._lease(handle, token, deadline)
        try:
            if span != expected:
                raise KVTransferError(
                    f"nixl: handle {handle.handle_id} does not describe what the source "
                    f"exposed under that id ({handle.nbytes} bytes at {handle.addr:#x}): "
                    "a forged or corrupted handle"
                )
            self._read(handle, *pair_up(local, remote), keepalive, token, deadline)
        except BaseException:
            self._abort(handle, token)
            raise

    def _out_region(self, out: torch.Tensor) -> None:
        """Make sure `out` lies in registered memory: a pool, or a cached registration."""
        if self._pool_for(out) is not None:
            return
        key = (out.data_ptr(), out.nbytes)
        if key in self._outs:
            self._outs.move_to_end(key)
            return
        self._outs[key] = self._register(out)
        while len(self._outs) > self._max_cached_outs:
            self._agent.deregister(self._outs.popitem(last=False)[1])

    def _load_peer(self, handle: NixlHandle) -> None:
        """Load the metadata of the handle's registration once. NIXL only ever adds remote
        registrations; one that overlaps a new one was deregistered by the source since
        (the memory was reused), and NIXL could match READs against it, so the peer's view
        is then rebuilt from scratch (`register_pool` avoids it)."""
        loaded = self._remote.setdefault(handle.agent_name, {})
        if handle.reg_id in loaded:
            return
        start, nbytes = handle.reg_range
        stale = any(a < start + nbytes and start < a + n for a, n in loaded.values())
        name = self._agent.load(handle.agent_metadata, forget=handle.agent_name if stale else None)
        if stale:
            loaded.clear()
        if name != handle.agent_name:
            raise KVTransferError(f"nixl: handle names agent {handle.agent_name!r}, not {name!r}")
        loaded[handle.reg_id] = handle.reg_range
        self._peers.add(name)

    def _lease(self, handle: NixlHandle, token: int, deadline: float) -> tuple[int, int]:
        """BEGIN, then wait for the ACK: the leased (address, nbytes)."""
        payload = self._agent.conn_metadata
        begin = Message(BEGIN, lease_request(deadline), handle.handle_id, token, payload)
        self._agent.notify(handle.agent_name, begin)
        while time.monotonic() < deadline:
            self._pump()
            ack = self._acks.pop(token, None)
            if ack is None:
                continue
            if ack.status != OK:
                raise KVTransferError(
                    f"nixl: handle {handle.handle_id} is released or unknown at the source "
                    f"{handle.agent_name}; expose the tensor again"
                )
            return ACK_PAYLOAD.unpack(ack.payload)
        self._abort(handle, token)  # in case the BEGIN is answered after we gave up
        raise KVTransferError(
            f"nixl: no answer from source agent {handle.agent_name} for handle "
            f"{handle.handle_id} before the timeout: the source is gone, closed, or stalled"
        )

    def _read(self, handle: NixlHandle, local: Segments, remote: Segments, keepalive: torch.Tensor,
              token: int, deadline: float) -> None:
        done = Message(DONE, 0, handle.handle_id, token)
        xfer, state = self._agent.start_read(local, handle.agent_name, remote, done)
        stuck = False
        try:
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.state(xfer)
        finally:
            try:
                self._agent.release_xfer(xfer)
            except Exception:  # an unfinished READ cannot always be cancelled: keep memory alive
                log.warning("nixl: could not release an unfinished transfer", exc_info=True)
                self._stuck.append((xfer, keepalive))
                stuck = True
        if state != "DONE":
            what = "timed out" if state == "PROC" else f"ended in state {state}"
            error = TransferStillRunningError if stuck else KVTransferError
            raise error(f"nixl: READ of {handle.nbytes} bytes from {handle.agent_name} {what}")

    def _abort(self, handle: NixlHandle, token: int) -> None:
        try:
            self._agent.notify(handle.agent_name, Message(ABORT, 0, handle.handle_id, token))
        except KVTransferError:
            log.warning("nixl: could not send ABORT to %s", handle.agent_name, exc_info=True)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._poller.join(timeout=5.0)
        run_cleanups(self._leases.close())
        for region in [*self._outs.values(), *self._pools]:
            self._agent.deregister(region)
        self._outs.clear()
        self._pools.clear()
        self._agent.close(self._peers)

