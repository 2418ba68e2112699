"""`local`: same-process transport, the reference every other transport is tested against.

`expose` records a reference to the tensor in a process-wide table (so two transport
instances in one process, e.g. two in-process replicas, can exchange handles); `fetch`
is one `out.copy_(exposed)`. The handle carries the owning process id: using it in
another process raises KVTransferError instead of reading anything.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from aaflow.common.errors import KVTransferError

from .base import TransferHandle, Transport, as_bytes


@dataclass(frozen=True)
class LocalHandle(TransferHandle):
    pid: int
    """Process that exposed the tensor; the handle is meaningless anywhere else."""


class _ExposedTensors:
    """The process-wide table of exposed tensors (handle id -> tensor)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] = {}

    def put(self, handle_id: str, tensor: torch.Tensor) -> None:
        with self._lock:
            self._tensors[handle_id] = tensor

    def get(self, handle_id: str) -> torch.Tensor | None:
        with self._lock:
            return self._tensors.get(handle_id)

    def pop(self, handle_id: str) -> None:
        with self._lock:
            self._tensors.pop(handle_id, None)


_EXPOSED = _ExposedTensors()


class LocalTransport(Transport):
    """In-process copy; `fetch` bandwidth is the memcpy bound of this machine."""

    name = "local"
    handle_type = LocalHandle

    def __init__(self) -> None:
        super().__init__()
        self._mine: set[str] = set()

    def expose(self, tensor: torch.Tensor) -> LocalHandle:
        handle = LocalHandle(**self._new_handle_fields(tensor), pid=os.getpid())
        _EXPOSED.put(handle.handle_id, tensor)
        self._mine.add(handle.handle_id)
        return handle

    def _fetch(self, handle: TransferHandle, out: torch.Tensor, deadline: float) -> None:
        assert isinstance(handle, LocalHandle)
        if handle.pid != os.getpid():
            raise KVTransferError(
                f"local: handle was exposed by process {handle.pid}, this is {os.getpid()}; "
                "the local transport only works inside one process: use ray, nixl or ucx"
            )
        source = _EXPOSED.get(handle.handle_id)
        if source is None:
            raise KVTransferError(
                f"local: handle {handle.handle_id} is released or unknown; expose the tensor again"
            )
        if source.nbytes != handle.nbytes:
            raise KVTransferError(
                f"local: handle says {handle.nbytes} bytes, tensor has {source.nbytes}"
            )
        as_bytes(out).copy_(as_bytes(source))

    def release(self, handle: TransferHandle) -> None:
        handle_id = getattr(handle, "handle_id", None)
        if handle_id in self._mine:
            self._mine.discard(handle_id)
            _EXPOSED.pop(handle_id)

    def close(self) -> None:
        for handle_id in self._mine:
            _EXPOSED.pop(handle_id)
        self._mine.clear()
        self._closed = True
