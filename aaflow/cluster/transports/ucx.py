"""`ucx`: UCX tag messages through ucxx, the maintained successor of ucx-py.

`ucx-py` no longer installs from PyPI (only a stub whose build downloads from an
unreachable index); `pip install ucxx-cu12` (0.52) installs and imports without a GPU.
Its Python API has tag, stream and active-message transfers but no RMA (no memory map,
remote key or get), so this transport is two-sided: the source *sends* the exposed tensor
straight from its memory and the destination *receives* straight into `out` (UCX's
rendezvous protocol, no staging copy in Python). No listener is started (ucxx listeners
bind every interface): workers reach each other by worker address, carried in the handle
(source) and in the request (destination).

Protocol, for one fetch of handle H exposed by worker S into `out` on worker D:
1. D sends BEGIN(H, token, D's address) to S's control tag.
2. S's service thread leases H (see `_leases`), answers ACK(OK | GONE, size) on tag
   ACK|token, then sends H's bytes on tag DATA|token and ends the lease when the send
   completes. A released or unknown H is answered GONE: D fails fast.
3. D probes for ACK then for DATA, and only once DATA has arrived posts the receive into
   `out` (a fetch that gave up never has a receive posted into `out`); on timeout it sends
   ABORT, and S drops its endpoint to D if that send is still stuck.

Progress: no ucxx progress thread (its blocking mode wakes up per event and cuts the
bandwidth; its polling mode burns a core per endpoint). A service thread instead
waits in `epoll` while nothing is in flight (no CPU when idle, woken by the next message)
and spins `progress()` while a send is in flight; a fetching thread spins `progress()`
itself. `_ucx_worker.WorkerHost` wraps the worker, its endpoints and its sends in flight.

UCX settings come from the constructor, else UCX_TLS / UCX_NET_DEVICES in the environment,
else `self,posix,sysv` / `lo`; they go to this UCX context only (and the variables that
`import ucxx` writes into os.environ are removed again). Endpoint error handling is off by
default (on, loopback bandwidth drops sharply); a dead peer is noticed by the timeout.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from aaflow.common.errors import KVTransferError

from ._leases import ABORT, ACK, BEGIN, GONE, OK, LeaseTable, Message, lease_request
from ._ucx_worker import Send, WorkerHost
from .base import TransferHandle, Transport, as_bytes, package_missing

log = logging.getLogger(__name__)
_CTRL_TAG = 0xAAF0_0000_0000_0001
_ACK_BIT, _DATA_BIT = 1 << 62, 2 << 62
_TOKEN_MASK = (1 << 62) - 1
_SIZE = struct.Struct("<Q")
_CONTROL_SEND_S = 10.0  # a control message not delivered by then: its receiver is gone
_IDLE_WAIT_MS = 50  # longest the idle service thread sleeps in epoll (bounds close())


@dataclass(frozen=True)
class UcxHandle(TransferHandle):
    worker_address: bytes
    """The source's UCX worker address (sealed: UCX aborts the process on a damaged one)."""


class UcxTransport(Transport):
    name = "ucx"
    handle_type = UcxHandle

    def __init__(
        self,
        ucx_tls: str | None = None,
        net_devices: str | None = None,
        endpoint_error_handling: bool = False,
        max_lease_s: float = 255.0,
    ) -> None:
        """`ucx_tls`/`net_devices`: UCX TLS / NET_DEVICES; `endpoint_error_handling`:
        UCX peer-failure detection (slow here); `max_lease_s`: longest a reader may hold
        an exposure."""
        super().__init__()
        config = {
            "TLS": ucx_tls or os.environ.get("UCX_TLS") or "self,posix,sysv",
            "NET_DEVICES": net_devices or os.environ.get("UCX_NET_DEVICES") or "lo",
            "RNDV_THRESH": "8192",  # what `import ucxx` would put in os.environ
            "MAX_RNDV_RAILS": "1",
        }
        self._worker = WorkerHost(config, endpoint_error_handling)
        self._max_lease_s = max_lease_s
        self._leases = LeaseTable()
        self._tokens = itertools.count(random.getrandbits(48))
        self._stop = threading.Event()
        self._server = threading.Thread(target=self._serve, name="ucx-service", daemon=True)
        self._server.start()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        missing = package_missing("ucxx")
        return f"{missing}; pip install ucxx-cu12==0.52.0" if missing else None

    # -- source side ---------------------------------------------------------------------------

    def expose(self, tensor: torch.Tensor) -> UcxHandle:
        fields = self._new_handle_fields(tensor)
        self._leases.add(fields["handle_id"], tensor, None)  # tag sends need no registration
        return UcxHandle(**fields, worker_address=self._worker.address)

    def release(self, handle: TransferHandle) -> None:
        self._leases.release(getattr(handle, "handle_id", ""))

    def _serve(self) -> None:
        """Service thread: progress the worker, answer BEGINs, end leases of finished sends."""
        next_expiry = time.monotonic()
        while not self._stop.is_set():
            try:
                probe = self._worker.probe(_CTRL_TAG)
                if probe is not None:
                    buffer = np.empty(probe.length, dtype=np.uint8)
                    self._worker.receive(probe, buffer, time.monotonic() + 5.0, "control")
                    self._on_control(Message.decode(buffer.tobytes()))
                self._end_leases(self._worker.reap())
                if time.monotonic() >= next_expiry:
                    self._leases.expire()
                    next_expiry = time.monotonic() + 1.0
                if probe is not None or self._worker.busy():
                    self._worker.progress()  # a peer is reading: keep spinning
                else:
                    self._worker.wait_for_event(_IDLE_WAIT_MS)
            except Exception:  # one bad peer must not stop the service for the others
                log.exception("ucx: service thread error")
                self._stop.wait(0.01)

    def _on_control(self, message: Message | None) -> None:
        if message is None:
            return
        if message.kind == ABORT:  # the reader gave up: cancel what we still send it
            self._end_leases(self._worker.reap(token=message.token))
            return
        if message.kind != BEGIN:
            return
        peer, token = message.payload, message.token
        lease_s = min(message.status, self._max_lease_s)
        tensor = self._leases.acquire(message.handle_id, token, lease_s)
        status, size = (GONE, 0) if tensor is None else (OK, tensor.nbytes)
        ack = Message(ACK, status, message.handle_id, token, _SIZE.pack(size))
        try:
            self._send_control(peer, _ACK_BIT | token, ack)
            if tensor is not None:
                data, deadline = as_bytes(tensor).numpy(), time.monotonic() + lease_s
                send = Send(None, peer, data, deadline, token, (message.handle_id, token))
                self._worker.send(peer, _DATA_BIT | token, data, send)
        except KVTransferError:
            if tensor is not None:
                self._leases.end(message.handle_id, token)
            raise

    def _end_leases(self, leases: list[tuple[str, int]]) -> None:
        for handle_id, token in leases:
            self._leases.end(handle_id, token)

    # -- destination side ----------------------------------------------------------------------

    def _fetch(self, handle: TransferHandle, out: torch.Tensor, deadline: float) -> None:
        assert isinstance(handle, UcxHandle)
        token = next(self._tokens) & _TOKEN_MASK
        source = handle.worker_address
        begin = Message(
            BEGIN, lease_request(deadline), handle.handle_id, token, self._worker.address
        )
        self._send_control(source, _CTRL_TAG, begin)
        try:
            probe = self._probe(_ACK_BIT | token, deadline, "answer")
            answer = np.empty(probe.length, dtype=np.uint8)
            self._worker.receive(probe, answer, deadline, "answer")
            message = Message.decode(answer.tobytes())
            if message is None or message.status != OK:
                raise KVTransferError(
                    f"ucx: handle {handle.handle_id} is released or unknown at the source; "
                    "expose the tensor again"
                )
            (size,) = _SIZE.unpack(message.payload)
            if size != handle.nbytes:
                raise KVTransferError(f"ucx: handle says {handle.nbytes} bytes, source has {size}")
            probe = self._probe(_DATA_BIT | token, deadline, "data")
            if probe.length != out.nbytes:
                raise KVTransferError(f"ucx: {probe.length} bytes came for {out.nbytes} of out")
            self._worker.receive(probe, as_bytes(out).numpy(), deadline, "data")
        except Exception:
            try:
                self._send_control(source, _CTRL_TAG, Message(ABORT, 0, handle.handle_id, token))
            except KVTransferError as err:
                log.warning("ucx: could not send ABORT: %s", err)
            raise

    def _probe(self, tag: int, deadline: float, what: str) -> object:
        """Spin until the message with `tag` arrives; KVTransferError at the deadline."""
        while (probe := self._worker.probe(tag)) is None:
            if time.monotonic() > deadline:
                raise KVTransferError(
                    f"ucx: no {what} from the source before the timeout: "
                    "the source is gone, closed, or overloaded"
                )
            self._worker.progress()
        return probe

    def _send_control(self, peer: bytes, tag: int, message: Message) -> None:
        """Send a small control message without waiting for it to complete."""
        buffer = np.frombuffer(message.encode(), np.uint8).copy()
        send = Send(None, peer, buffer, time.monotonic() + _CONTROL_SEND_S, message.token)
        self._worker.send(peer, tag, buffer, send)

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._server.join(timeout=5.0)
        self._worker.close()
        self._leases.close()
