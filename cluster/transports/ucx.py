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
2. S's control thread leases H (see `_leases`), answers ACK(OK | GONE, size) on tag
   ACK|token, then sends H's bytes on tag DATA|token and ends the lease when the send
   completes. A released or unknown H is answered GONE: D fails fast.
3. D probes for ACK then for DATA, and only once DATA has arrived posts the receive into
   `out` (a fetch that gave up never has a receive posted into `out`); on timeout it sends
   ABORT, and S drops its endpoint to D if that send is still stuck.

Progress: no ucxx progress thread (its blocking mode wakes up per event and halves the
bandwidth here; its polling mode burns a core per endpoint). A service thread instead
waits in `epoll` while nothing is in flight (no CPU when idle, woken by the next message)
and spins `progress()` while a send is in flight; a fetching thread spins `progress()`
itself. UCX settings come from the
constructor, else UCX_TLS / UCX_NET_DEVICES in the environment, else `self,posix,sysv` /
`lo`; they are passed to this UCX context only (no global environment change). Endpoint
error handling is off by default (on, loopback bandwidth falls below 1 GB/s); a dead peer
is then noticed by the timeout.
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

from aaflow.errors import KVTransferError

from ._leases import ABORT, ACK, BEGIN, GONE, OK, LeaseTable, Message, lease_request, seal, unseal
from .base import TransferHandle, Transport, TransportUnavailableError, as_bytes, package_missing

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


@dataclass
class _Send:
    """A send in flight; a data send's lease ends when `request` completes."""

    request: object
    handle_id: str  # "" for control messages, which hold no lease
    token: int
    peer: bytes  # worker address of the receiver
    keep: object  # the send buffer, which must outlive the request
    deadline: float  # monotonic; past it the receiver is presumed gone


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
            "RNDV_THRESH": "8192",  # what `import ucxx` would set in os.environ
            "MAX_RNDV_RAILS": "1",
        }
        ucx_api, self._array = _import_ucxx()
        self._api = ucx_api
        self._context = ucx_api.UCXContext(
            config_dict=config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        )
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._address = seal(bytes(self._worker.address.tobytes()))
        self._error_handling = endpoint_error_handling
        self._max_lease_s = max_lease_s
        self._lock = threading.Lock()  # guards endpoints and sends
        self._endpoints: dict[bytes, object] = {}
        self._sends: list[_Send] = []
        self._abandoned: list[_Send] = []
        self._leases = LeaseTable()
        self._tokens = itertools.count(random.getrandbits(48))
        self._stop = threading.Event()
        self._server = threading.Thread(target=self._serve, name="ucx-control", daemon=True)
        self._server.start()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        missing = package_missing("ucxx")
        return f"{missing}; pip install ucxx-cu12==0.52.0" if missing else None

    # -- source side ---------------------------------------------------------------------------

    def expose(self, tensor: torch.Tensor) -> UcxHandle:
        fields = self._new_handle_fields(tensor)
        self._leases.add(fields["handle_id"], tensor, None)  # tag sends need no registration
        return UcxHandle(**fields, worker_address=self._address)

    def release(self, handle: TransferHandle) -> None:
        self._leases.release(getattr(handle, "handle_id", ""))

    def _serve(self) -> None:
        """Service thread: progress the worker, answer BEGINs, end leases of finished sends."""
        next_expiry = time.monotonic()
        while not self._stop.is_set():
            try:
                message = self._receive_control()
                if message is not None:
                    self._on_control(message)
                self._reap_sends()
                if time.monotonic() >= next_expiry:
                    self._leases.expire()
                    next_expiry = time.monotonic() + 1.0
                if message is not None or self._sends:
                    self._worker.progress()  # a peer is reading: keep spinning
                else:
                    self._worker.progress_worker_event(epoll_timeout=_IDLE_WAIT_MS)  # GIL released
            except Exception:  # one bad peer must not stop the service for the others
                log.exception("ucx: service thread error")
                self._stop.wait(0.01)

    def _receive_control(self) -> Message | None:
        probe = self._worker.tag_probe(self._api.UCXXTag(_CTRL_TAG), remove=True)
        if not probe.matched:
            return None
        buffer = np.empty(probe.length, dtype=np.uint8)
        request = self._worker.tag_recv_with_handle(self._array(buffer), probe)
        self._wait(request, time.monotonic() + 5.0, "control message")
        return Message.decode(buffer.tobytes())

    def _on_control(self, message: Message) -> None:
        if message.kind == ABORT:
            self._abandon(message.token)
            return
        if message.kind != BEGIN:
            return
        endpoint = self._endpoint(message.payload)
        lease_s = min(message.status, self._max_lease_s)
        tensor = self._leases.acquire(message.handle_id, message.token, lease_s)
        status, size = (GONE, 0) if tensor is None else (OK, tensor.nbytes)
        ack = Message(ACK, status, message.handle_id, message.token, _SIZE.pack(size)).encode()
        ack_buffer = np.frombuffer(ack, dtype=np.uint8).copy()
        ack_request = endpoint.tag_send(
            self._array(ack_buffer), self._api.UCXXTag(_ACK_BIT | message.token)
        )
        self._track(
            _Send(
                ack_request,
                "",
                message.token,
                message.payload,
                ack_buffer,
                time.monotonic() + _CONTROL_SEND_S,
            )
        )
        if tensor is not None:
            array = as_bytes(tensor).numpy()
            data = endpoint.tag_send(
                self._array(array), self._api.UCXXTag(_DATA_BIT | message.token)
            )
            self._track(
                _Send(
                    data,
                    message.handle_id,
                    message.token,
                    message.payload,
                    array,
                    time.monotonic() + lease_s,
                )
            )

    def _track(self, send: _Send) -> None:
        with self._lock:
            self._sends.append(send)

    def _reap_sends(self) -> None:
        """End the leases of completed sends; give up on sends past their deadline."""
        now = time.monotonic()
        with self._lock:
            sends, self._sends = self._sends, []
            for send in sends:
                if send.request.completed:
                    if send.handle_id:
                        self._leases.end(send.handle_id, send.token)
                elif send.deadline < now:
                    self._give_up(send)
                else:
                    self._sends.append(send)

    def _abandon(self, token: int) -> None:
        """The reader of `token` gave up: give up our sends to it that are still stuck."""
        with self._lock:
            sends, self._sends = self._sends, []
            for send in sends:
                if send.token == token and not send.request.completed:
                    self._give_up(send)
                else:
                    self._sends.append(send)

    def _give_up(self, send: _Send) -> None:
        """Drop a stuck send (caller holds the lock): closing its endpoint cancels it."""
        endpoint = self._endpoints.pop(send.peer, None)
        if endpoint is not None:
            endpoint.close()  # a later BEGIN from that peer reconnects
        self._abandoned.append(send)  # its buffer stays alive until close()
        if send.handle_id:
            self._leases.end(send.handle_id, send.token)

    # -- destination side ----------------------------------------------------------------------

    def _fetch(self, handle: TransferHandle, out: torch.Tensor, deadline: float) -> None:
        assert isinstance(handle, UcxHandle)
        token = next(self._tokens) & _TOKEN_MASK
        begin = Message(BEGIN, lease_request(deadline), handle.handle_id, token, self._address)
        self._send_control(handle.worker_address, begin)
        try:
            ack = self._probe(_ACK_BIT | token, deadline, "answer")
            message = Message.decode(
                self._receive(ack, np.empty(ack.length, np.uint8), deadline, "answer")
            )
            if message is None or message.status != OK:
                raise KVTransferError(
                    f"ucx: handle {handle.handle_id} is released or unknown at the source; "
                    "expose the tensor again"
                )
            (size,) = _SIZE.unpack(message.payload)
            if size != handle.nbytes:
                raise KVTransferError(
                    f"ucx: handle says {handle.nbytes} bytes, source exposed {size}"
                )
            data = self._probe(_DATA_BIT | token, deadline, "data")
            if data.length != out.nbytes:
                raise KVTransferError(
                    f"ucx: {data.length} bytes arrived for a {out.nbytes}-byte out"
                )
            self._receive(data, as_bytes(out).numpy(), deadline, "data")
        except Exception:
            self._send_control(
                handle.worker_address, Message(ABORT, 0, handle.handle_id, token), quiet=True
            )
            raise

    def _receive(
        self, probe: object, buffer: np.ndarray, deadline: float, what: str
    ) -> bytes | None:
        """Receive a probed message into `buffer`; on timeout keep `buffer` alive (UCX may
        still write into it) and raise."""
        request = self._worker.tag_recv_with_handle(self._array(buffer), probe)
        try:
            self._wait(request, deadline, what)
        except KVTransferError:
            with self._lock:
                self._abandoned.append(_Send(request, "", 0, b"", buffer, 0.0))
            raise
        return buffer.tobytes() if buffer.nbytes <= 4096 else None

    def _probe(self, tag: int, deadline: float, what: str) -> object:
        while True:
            probe = self._worker.tag_probe(self._api.UCXXTag(tag), remove=True)
            if probe.matched:
                return probe
            if time.monotonic() > deadline:
                raise KVTransferError(
                    f"ucx: no {what} from the source before the timeout: "
                    "the source is gone, closed, or overloaded"
                )
            self._worker.progress()

    def _wait(self, request: object, deadline: float, what: str) -> None:
        while not request.completed:
            if time.monotonic() > deadline:
                raise KVTransferError(f"ucx: {what} did not complete before the timeout")
            self._worker.progress()
        try:
            request.check_error()
        except Exception as err:
            raise KVTransferError(f"ucx: {what} failed: {err!r}") from err

    def _send_control(self, address: bytes, message: Message, quiet: bool = False) -> None:
        """Send a control message to the worker at `address` without waiting for it."""
        buffer = np.frombuffer(message.encode(), np.uint8).copy()
        try:
            request = self._endpoint(address).tag_send(
                self._array(buffer), self._api.UCXXTag(_CTRL_TAG)
            )
        except Exception as err:
            if quiet:
                log.warning("ucx: could not send %s: %r", message.kind, err)
                return
            if isinstance(err, KVTransferError):
                raise
            raise KVTransferError(f"ucx: cannot send to the source: {err!r}") from err
        self._track(
            _Send(request, "", message.token, address, buffer, time.monotonic() + _CONTROL_SEND_S)
        )

    # -- shared --------------------------------------------------------------------------------

    def _endpoint(self, address: bytes) -> object:
        with self._lock:
            endpoint = self._endpoints.get(address)
        if endpoint is not None:
            return endpoint
        raw = unseal(address)
        if raw is None:
            raise KVTransferError("ucx: the worker address is damaged (checksum mismatch)")
        try:
            ucx_address = self._api.UCXAddress.create_from_buffer(raw)
            endpoint = self._api.UCXEndpoint.create_from_worker_address(
                self._worker, ucx_address, endpoint_error_handling=self._error_handling
            )
        except Exception as err:
            raise KVTransferError(
                f"ucx: cannot connect to the worker address in the handle: {err!r}"
            ) from err
        with self._lock:
            return self._endpoints.setdefault(address, endpoint)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._server.join(timeout=5.0)
        self._leases.close()
        with self._lock:
            endpoints, self._endpoints = list(self._endpoints.values()), {}
            self._sends.clear()
            self._abandoned.clear()
        for endpoint in endpoints:
            try:
                endpoint.close()
            except Exception:
                pass
        self._worker = self._context = None


def _import_ucxx():
    """Import ucxx without keeping the UCX_* variables its `__init__` puts in os.environ
    (they would also reach NIXL's UCX in the same process); ours go in the config dict."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    try:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
    except ImportError as err:
        raise TransportUnavailableError(
            f"ucx: cannot import ucxx ({err}); pip install ucxx-cu12==0.52.0"
        ) from err
    finally:
        for key in [k for k in os.environ if k.startswith("UCX_") and k not in saved]:
            del os.environ[key]
        os.environ.update(saved)
    return ucx_api, Array
