"""`ray`: the Ray object store (plasma shared memory on one node, Ray's transfer across nodes).

- `expose`: one `ray.put` of `(handle_id, flat uint8 numpy view)`: a copy into plasma,
  paid on the source (cold plasma pages make it slow the first time; start Ray with
  `RAY_preallocate_plasma_memory=1` to pay that at startup).
- `fetch`: `ray.get` returns a zero-copy, read-only numpy view of plasma; it is copied
  into `out` once (`torch.copy_`). The stored id guards against a forged handle.
- `release`: drops the owner's reference. Ray keeps a borrowed object alive while any
  copy of the handle exists (and Ray 2.60 has no `free`), so `release` also writes a
  revocation marker (one small key in the GCS internal KV, namespace `aaflow-transport`)
  that `fetch` checks: a released handle raises KVTransferError. That check costs one GCS
  round trip per fetch; `check_revoked=False` skips it (fetch of a
  released handle then returns the exact exposed bytes: plasma objects are immutable).
  Markers stay until the Ray cluster shuts down (~40 bytes each).

The source process owns the object: if it exits, fetches raise KVTransferError.
Needs `ray.init()` in both processes (Ray actors have it).
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.experimental import internal_kv

from aaflow.common.errors import KVTransferError

from .base import TransferHandle, Transport, TransportUnavailableError, as_bytes, package_missing

# Reading the plasma view through torch (multi-threaded, faster than numpy's copy) wraps a
# read-only array; we only ever read it, so torch's warning about that is noise.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=__name__)


@dataclass(frozen=True)
class RayHandle(TransferHandle):
    ref: Any
    """`ray.ObjectRef` of `(handle_id, uint8 array)`, owned by the exposing process."""


class RayStoreTransport(Transport):
    name = "ray"
    handle_type = RayHandle

    def __init__(self, check_revoked: bool = True) -> None:
        super().__init__()

        if not ray.is_initialized():
            raise TransportUnavailableError(
                "ray: Ray is not initialized in this process; call ray.init() (or use the "
                "transport inside a Ray actor)"
            )
        self._ray = ray
        self._kv = internal_kv
        self._check_revoked = check_revoked
        self._lock = threading.Lock()
        self._refs: dict[str, Any] = {}

    @classmethod
    def unavailable_reason(cls) -> str | None:
        missing = package_missing("ray")
        return f'{missing}; pip install "ray[default]>=2.60,<2.61"' if missing else None

    def expose(self, tensor: torch.Tensor) -> RayHandle:
        fields = self._new_handle_fields(tensor)
        ref = self._ray.put((fields["handle_id"], as_bytes(tensor).numpy()))
        with self._lock:
            self._refs[fields["handle_id"]] = ref
        return RayHandle(**fields, ref=ref)

    def _fetch(self, handle: TransferHandle, out: torch.Tensor, deadline: float) -> None:
        assert isinstance(handle, RayHandle)
        if not isinstance(handle.ref, self._ray.ObjectRef):
            raise KVTransferError(
                f"ray: handle.ref is {type(handle.ref).__name__}, not an ObjectRef"
            )
        try:
            stored_id, view = self._ray.get(
                handle.ref, timeout=max(deadline - time.monotonic(), 0.001)
            )
        except self._ray.exceptions.GetTimeoutError as err:
            raise KVTransferError(
                f"ray: object of handle {handle.handle_id} not ready in time"
            ) from err
        except self._ray.exceptions.RayError as err:
            raise KVTransferError(
                f"ray: handle {handle.handle_id} is released, or its owner died "
                f"({type(err).__name__}); expose the tensor again"
            ) from err
        if stored_id != handle.handle_id or view.nbytes != handle.nbytes:
            raise KVTransferError(
                f"ray: handle {handle.handle_id} does not match the stored object "
                f"({stored_id}, {view.nbytes} bytes): a forged or corrupted handle"
            )
        if self._check_revoked and self._kv._internal_kv_exists(
            _marker(handle.handle_id), namespace=_KV_NAMESPACE
        ):
            raise KVTransferError(
                f"ray: handle {handle.handle_id} was released; expose the tensor again"
            )
        as_bytes(out).copy_(torch.from_numpy(view))  # plasma (read-only view) -> out, one copy

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            ref = self._refs.pop(getattr(handle, "handle_id", None), None)
        if ref is not None:
            self._revoke(handle.handle_id)

    def _revoke(self, handle_id: str) -> None:
        self._kv._internal_kv_put(_marker(handle_id), b"1", namespace=_KV_NAMESPACE)

    def close(self) -> None:
        with self._lock:
            handle_ids, self._refs = list(self._refs), {}
        if self._ray.is_initialized():
            for handle_id in handle_ids:
                self._revoke(handle_id)
        self._closed = True


_KV_NAMESPACE = "aaflow-transport"


def _marker(handle_id: str) -> bytes:
    return b"revoked:" + handle_id.encode()
