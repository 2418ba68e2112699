"""A ucxx worker with the few tag operations `ucx.py` needs, and its sends in flight.

No ucxx progress thread: `progress()` and `wait_for_event()` are called by the transport's
threads. Every send keeps its buffer alive until it completes or is given up (an endpoint
close cancels it); buffers of receives abandoned at a timeout are kept until `close()`,
since UCX may still write into them. Worker addresses are sealed (`_leases.seal`): UCX
aborts the whole process on a damaged one.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from aaflow.common.errors import KVTransferError

from ._leases import seal, unseal
from .base import TransportUnavailableError


@dataclass
class Send:
    """A send in flight; `lease` (handle id, token) ends when it completes or is given up."""

    request: object
    peer: bytes  # sealed worker address of the receiver
    buffer: object  # must outlive the request
    deadline: float  # monotonic; past it the receiver is presumed gone
    token: int
    lease: tuple[str, int] | None = None


class WorkerHost:
    def __init__(self, config: dict[str, str], endpoint_error_handling: bool) -> None:
        self._api, self._array = _import_ucxx()
        features = (self._api.Feature.TAG, self._api.Feature.WAKEUP)
        self._context = self._api.UCXContext(config_dict=config, feature_flags=features)
        self._worker = self._api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self.address = seal(bytes(self._worker.address.tobytes()))
        self._error_handling = endpoint_error_handling
        self._lock = threading.Lock()  # guards endpoints and send lists
        self._endpoints: dict[bytes, object] = {}
        self._sends: list[Send] = []
        self._kept: list[object] = []  # buffers UCX may still touch: kept until close()

    # -- progress ------------------------------------------------------------------------------

    def progress(self) -> None:
        self._worker.progress()

    def wait_for_event(self, timeout_ms: int) -> None:
        """Progress, then sleep in epoll until a network event or `timeout_ms` (GIL released)."""
        self._worker.progress_worker_event(epoll_timeout=timeout_ms)

    def wait(self, request: object, deadline: float, what: str) -> None:
        """Spin `progress()` until `request` completes; KVTransferError at the deadline."""
        while not request.completed:
            if time.monotonic() > deadline:
                raise KVTransferError(f"ucx: {what} did not complete before the timeout")
            self._worker.progress()
        try:
            request.check_error()
        except Exception as err:
            raise KVTransferError(f"ucx: {what} failed: {err!r}") from err

    # -- tag operations ------------------------------------------------------------------------

    def send(self, peer: bytes, tag: int, buffer: np.ndarray, send: Send) -> None:
        """Post a tag send of `buffer` to the worker at `peer`; tracked as `send`."""
        endpoint = self._endpoint(peer)
        try:
            send.request = endpoint.tag_send(self._array(buffer), self._api.UCXXTag(tag))
        except Exception as err:
            raise KVTransferError(f"ucx: cannot send to the peer: {err!r}") from err
        with self._lock:
            self._sends.append(send)

    def probe(self, tag: int) -> object | None:
        """The message with `tag` that has arrived, removed from the queue, or None."""
        probe = self._worker.tag_probe(self._api.UCXXTag(tag), remove=True)
        return probe if probe.matched else None

    def receive(self, probe: object, buffer: np.ndarray, deadline: float, what: str) -> None:
        """Receive a probed message into `buffer` (blocking until done or the deadline)."""
        request = self._worker.tag_recv_with_handle(self._array(buffer), probe)
        try:
            self.wait(request, deadline, what)
        except KVTransferError:
            with self._lock:
                self._kept.append((request, buffer))
            raise

    # -- sends in flight -----------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self._sends)

    def reap(self, token: int | None = None) -> list[tuple[str, int]]:
        """Forget completed sends and give up on expired ones (or on every unfinished send
        with `token`, whose reader gave up); returns the leases that ended."""
        now, ended = time.monotonic(), []
        with self._lock:
            sends, self._sends = self._sends, []
            for send in sends:
                completed = send.request.completed
                if not completed and (send.deadline < now or send.token == token):
                    self._give_up(send)
                elif not completed:
                    self._sends.append(send)
                    continue
                if send.lease is not None:
                    ended.append(send.lease)
        return ended

    def _give_up(self, send: Send) -> None:
        """Closing the endpoint cancels the send (caller holds the lock)."""
        endpoint = self._endpoints.pop(send.peer, None)
        if endpoint is not None:
            endpoint.close()  # the next message to or from that peer reconnects
        self._kept.append((send.request, send.buffer))

    # -- endpoints -----------------------------------------------------------------------------

    def _endpoint(self, peer: bytes) -> object:
        with self._lock:
            endpoint = self._endpoints.get(peer)
        if endpoint is not None:
            return endpoint
        raw = unseal(peer)
        if raw is None:
            raise KVTransferError("ucx: the worker address is damaged (checksum mismatch)")
        try:
            address = self._api.UCXAddress.create_from_buffer(raw)
            endpoint = self._api.UCXEndpoint.create_from_worker_address(
                self._worker, address, endpoint_error_handling=self._error_handling
            )
        except Exception as err:
            raise KVTransferError(f"ucx: cannot connect to the worker address: {err!r}") from err
        with self._lock:
            return self._endpoints.setdefault(peer, endpoint)

    def close(self) -> None:
        with self._lock:
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            try:
                endpoint.close()  # cancels what is still in flight
            except Exception:
                pass
        for _ in range(100):  # let the cancellations complete before buffers are dropped
            self._worker.progress()
        with self._lock:
            self._sends.clear()
            self._kept.clear()
        self._worker = self._context = None


def _import_ucxx():
    """Import ucxx without keeping the UCX_* variables its `__init__` puts in os.environ
    (they would also reach NIXL's UCX in the same process); ours go in the config dict."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    try:
        import ucxx._lib.libucxx as ucx_api  # optional: ucxx (aaflow[transports])
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
